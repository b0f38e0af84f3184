// step_trace.cu: the host side of the decode-step probe (step_trace.h). Every CUDA file has its own copy of the
// device pointer the records go to (no relocatable device code), registered here by a static object (common.cuh).
#ifdef LILY_STEP_TRACE
#include <algorithm>
#include <mutex>

#include "backend/cuda/step_trace.h"
#include "backend/cuda/common.cuh"

namespace lily {
namespace cuda {
namespace {

struct TraceState {
  std::mutex lock;
  std::vector<void (*)(unsigned long long*)> setters;  // one per CUDA file
  std::vector<const void*> kernels;                    // launched during graph capture, in order
  unsigned long long* buf = nullptr;                   // device: [count, capacity, (grid, time) × capacity]
  size_t capacity = 0;
};

TraceState& state() {
  static TraceState s;
  return s;
}

}  // namespace

void step_trace_register(void (*set)(unsigned long long*)) {
  std::lock_guard<std::mutex> g(state().lock);
  state().setters.push_back(set);
}

bool step_trace_on() { return state().buf != nullptr; }

void step_trace_launch(const void* kernel) {
  std::lock_guard<std::mutex> g(state().lock);
  state().kernels.push_back(kernel);
}

}  // namespace cuda

void step_trace_start(size_t capacity) {
  using namespace cuda;
  TraceState& s = state();
  LILY_CHECK(!s.buf, "step_trace_start: already recording");
  LILY_CHECK(capacity > 0, "step_trace_start: capacity must be positive");
  LILY_CUDA_CHECK(cudaDeviceSynchronize());
  LILY_CUDA_CHECK(cudaMalloc(&s.buf, (2 + 2 * capacity) * sizeof(unsigned long long)));
  const unsigned long long head[2] = {0, capacity};
  LILY_CUDA_CHECK(cudaMemcpy(s.buf, head, sizeof(head), cudaMemcpyHostToDevice));
  s.capacity = capacity;
  s.kernels.clear();
  for (auto set : s.setters) set(s.buf);
}

StepTrace step_trace_stop() {
  using namespace cuda;
  TraceState& s = state();
  LILY_CHECK(s.buf, "step_trace_stop: not recording");
  LILY_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto set : s.setters) set(nullptr);
  unsigned long long n = 0;
  LILY_CUDA_CHECK(cudaMemcpy(&n, s.buf, sizeof(n), cudaMemcpyDeviceToHost));
  const size_t kept = std::min<size_t>(n, s.capacity);
  std::vector<unsigned long long> rec(2 * kept);
  if (kept) LILY_CUDA_CHECK(cudaMemcpy(rec.data(), s.buf + 2, rec.size() * sizeof(unsigned long long),
                                       cudaMemcpyDeviceToHost));
  LILY_CUDA_CHECK(cudaFree(s.buf));
  s.buf = nullptr;  // stopped, whatever follows
  LILY_CHECK(n <= s.capacity, "step trace: ", n, " records for a capacity of ", s.capacity,
             " (start it with a larger capacity)");
  StepTrace t;
  for (size_t i = 0; i < kept; ++i) {
    t.grids.push_back(rec[2 * i]);
    t.times.push_back(rec[2 * i + 1]);
  }
  for (const void* k : s.kernels) {
    const char* name = nullptr;
    t.names.push_back(cudaFuncGetName(&name, k) == cudaSuccess && name ? name : "?");
  }
  s.kernels.clear();
  return t;
}

}  // namespace lily
#endif
