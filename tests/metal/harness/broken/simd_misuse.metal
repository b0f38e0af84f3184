// simd_misuse.metal: collectives and simdgroup matrices used wrongly. Run with 48 threads (a partial second
// simdgroup of 16 lanes) unless noted.
#include <metal_stdlib>
using namespace metal;

// Lane l of the partial simdgroup reads lane l + 16, which does not exist.
[[kernel]] void inactive_lane(device const float* in [[buffer(0)]],
                              device float* out [[buffer(1)]],
                              constant uint& n [[buffer(2)]],
                              uint i [[thread_position_in_grid]]) {
  out[i] = simd_shuffle_down(in[i], 16);
}

// Odd and even lanes call different collectives.
[[kernel]] void divergent_collective(device const float* in [[buffer(0)]],
                                     device float* out [[buffer(1)]],
                                     constant uint& n [[buffer(2)]],
                                     uint i [[thread_position_in_grid]]) {
  float x = in[i];
  if (i % 2) {
    x = simd_sum(x);
  } else {
    x = simd_max(x);
  }
  out[i] = x;
}

// 32 threads: the lanes load the matrix from different addresses.
[[kernel]] void nonuniform_matrix(device const float* in [[buffer(0)]],
                                  device float* out [[buffer(1)]],
                                  constant uint& n [[buffer(2)]],
                                  uint t [[thread_index_in_threadgroup]]) {
  simdgroup_float8x8 a;
  simdgroup_load(a, in + (t % 2) * 64, 8);
  simdgroup_store(a, out, 8);
}

// 32 threads: 32 KB + 32 bytes of threadgroup memory, over Apple's limit.
[[kernel]] void too_much_threadgroup_memory(device const float* in [[buffer(0)]],
                                            device float* out [[buffer(1)]],
                                            constant uint& n [[buffer(2)]],
                                            uint t [[thread_index_in_threadgroup]]) {
  threadgroup float big[8200];
  big[t] = in[t];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[t] = big[t ^ 1];
}
