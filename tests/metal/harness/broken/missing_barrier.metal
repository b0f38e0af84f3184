// missing_barrier.metal: correct_reverse without its barrier: a thread reads another's slot that may not be written
// yet (a race that forward or reverse order exposes: the slot still holds the NaN poison).
#include <metal_stdlib>
using namespace metal;

[[kernel]] void missing_barrier(device const float* in [[buffer(0)]],
                                device float* out [[buffer(1)]],
                                constant uint& n [[buffer(2)]],
                                uint g [[threadgroup_position_in_grid]],
                                uint t [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  buf[t] = in[g * 64 + t];
  out[g * 64 + t] = buf[63 - t];
}
