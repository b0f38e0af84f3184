// early_return.metal: threads past the end return before a barrier the others wait at (undefined on Metal), and a
// barrier reached on two different lines.
#include <metal_stdlib>
using namespace metal;

[[kernel]] void early_return(device const float* in [[buffer(0)]],
                             device float* out [[buffer(1)]],
                             constant uint& n [[buffer(2)]],
                             uint g [[threadgroup_position_in_grid]],
                             uint t [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  if (g * 64 + t >= n) return;
  buf[t] = in[g * 64 + t];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[g * 64 + t] = buf[t ^ 1];
}

[[kernel]] void divergent_barrier(device const float* in [[buffer(0)]],
                                  device float* out [[buffer(1)]],
                                  constant uint& n [[buffer(2)]],
                                  uint t [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  buf[t] = in[t];
  if (t < 32) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[t] = buf[t ^ 1];
}
