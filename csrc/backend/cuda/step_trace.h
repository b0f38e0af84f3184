// step_trace.h: a build-time probe of the replayed decode step (CMake option LILY_STEP_TRACE, off in every build
// that ships). Each kernel's block 0 records, right after its PDL wait, the time (%globaltimer) at which its
// predecessor's results became visible to it; consecutive records of one step give each kernel's share of the
// step's critical path, with the overlap PDL allows (ncu profiles graph nodes one at a time, without it; nsys
// does not run on the lent machines). Every block also records its pdl_trigger, its first instructions: how long
// before block 0's wait returned PDL let it onto an SM. Read by benchmarks/probes/step_trace.py through
// lily._core.testing.
// Plain C++: included by the bindings as well as by the CUDA files.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lily {

// The record buffer (device): kTraceShards counters, one per SM (%smid mod kTraceShards), each on its own line of
// kTraceLine words; then a line whose first word is the records per shard; then each shard's (grid, time) records.
constexpr unsigned kTraceShards = 256;
constexpr unsigned kTraceLine = 16;

struct StepTrace {
  std::vector<std::string> names;  // the kernels of every graph captured while tracing, in launch order
  std::vector<uint64_t> grids;     // per record: the launch (%gridid; top bit set for a start record) ...
  std::vector<uint64_t> times;     // ... and when its block 0 passed the PDL wait, or (start record) reached its
                                   // pdl_trigger, its first instructions (ns, %globaltimer)
};

// Starts recording (up to `capacity` records: stopping after more is an error that says so).
void step_trace_start(size_t capacity);
// Stops recording and returns what was recorded since step_trace_start.
StepTrace step_trace_stop();

}  // namespace lily
