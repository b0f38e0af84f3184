// thread_limit.metal: a kernel that declares max_total_threads_per_threadgroup(64) (Apple's compiler then fits its
// registers to 64 threads, and the pipeline allows no more), dispatched with more threads than that.
#include <metal_stdlib>
using namespace metal;

[[kernel, max_total_threads_per_threadgroup(64)]] void thread_limit(device const float* in [[buffer(0)]],
                                                                     device float* out [[buffer(1)]],
                                                                     constant uint& n [[buffer(2)]],
                                                                     uint g [[threadgroup_position_in_grid]],
                                                                     uint t [[thread_index_in_threadgroup]],
                                                                     uint size [[threads_per_threadgroup]]) {
  out[g * size + t] = 2.0f * in[g * size + t];
}
