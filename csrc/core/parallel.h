// parallel.h: one persistent pool of worker threads and parallel_for over an index range.
// The CPU backend is the readable reference; threads are its only concession to speed.
// LILY_NUM_THREADS overrides the thread count (default: hardware concurrency).
#pragma once
#include <cstdint>
#include <functional>

namespace lily {

int num_threads();

// Calls fn(begin, end) on disjoint sub-ranges covering [0, n), in parallel; returns when all are done.
// Ranges hold at least `grain` indices. Nested calls run inline.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace lily
