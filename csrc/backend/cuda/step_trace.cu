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
  unsigned long long* buf = nullptr;                   // device: step_trace.h's layout
  size_t per = 0;                                      // records per shard
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
  int dev = 0, sms = 0;
  LILY_CUDA_CHECK(cudaGetDevice(&dev));
  LILY_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  // capacity spread over the SMs that record (every shard gets as much: %smid need not be below the SM count)
  const size_t per = (capacity + sms - 1) / std::max(sms, 1), head = (kTraceShards + 1) * kTraceLine;
  LILY_CUDA_CHECK(cudaMalloc(&s.buf, (head + 2 * per * kTraceShards) * sizeof(unsigned long long)));
  std::vector<unsigned long long> h(head, 0);
  h[kTraceShards * kTraceLine] = per;
  LILY_CUDA_CHECK(cudaMemcpy(s.buf, h.data(), head * sizeof(unsigned long long), cudaMemcpyHostToDevice));
  s.per = per;
  s.kernels.clear();
  for (auto set : s.setters) set(s.buf);
}

StepTrace step_trace_stop() {
  using namespace cuda;
  TraceState& s = state();
  LILY_CHECK(s.buf, "step_trace_stop: not recording");
  LILY_CUDA_CHECK(cudaDeviceSynchronize());
  for (auto set : s.setters) set(nullptr);
  const size_t head = (kTraceShards + 1) * kTraceLine;
  std::vector<unsigned long long> h(head), rec(2 * s.per * kTraceShards);
  LILY_CUDA_CHECK(cudaMemcpy(h.data(), s.buf, head * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  LILY_CUDA_CHECK(cudaMemcpy(rec.data(), s.buf + head, rec.size() * sizeof(unsigned long long),
                             cudaMemcpyDeviceToHost));
  LILY_CUDA_CHECK(cudaFree(s.buf));
  s.buf = nullptr;  // stopped, whatever follows
  StepTrace t;
  size_t most = 0;
  for (unsigned sh = 0; sh < kTraceShards; ++sh) {
    const size_t n = h[sh * kTraceLine];
    most = std::max(most, n);
    for (size_t i = 0; i < std::min(n, s.per); ++i) {
      t.grids.push_back(rec[2 * (sh * s.per + i)]);
      t.times.push_back(rec[2 * (sh * s.per + i) + 1]);
    }
  }
  LILY_CHECK(most <= s.per, "step trace: ", most, " records on one SM for a capacity of ", s.per,
             " per SM (start it with a larger capacity)");
  for (const void* k : s.kernels) {
    const char* name = nullptr;
    t.names.push_back(cudaFuncGetName(&name, k) == cudaSuccess && name ? name : "?");
  }
  s.kernels.clear();
  return t;
}

}  // namespace lily
#endif
