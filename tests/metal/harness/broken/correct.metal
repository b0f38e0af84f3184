// correct.metal: kernels without bugs, which must give the right result in every order and under ASan
// (tests/metal/test_harness.py). Driver conventions: tests/metal/harness/driver.cpp.
#include <metal_stdlib>
using namespace metal;

// 64 threads per group: out[i] = in[mirror of i in its group] + Σ in over i's simdgroup + in[i ^ 1].
[[kernel]] void correct_reverse(device const float* in [[buffer(0)]],
                                device float* out [[buffer(1)]],
                                constant uint& n [[buffer(2)]],
                                uint g [[threadgroup_position_in_grid]],
                                uint t [[thread_index_in_threadgroup]]) {
  threadgroup float buf[64];
  const float x = in[g * 64 + t];
  buf[t] = x;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[g * 64 + t] = buf[63 - t] + simd_sum(x) + simd_shuffle_xor(x, 1);
}

// One simdgroup: out (8×8) = A · B with A = in[0, 64) and B = in[64, 128), row-major.
[[kernel]] void correct_matmul(device const float* in [[buffer(0)]],
                               device float* out [[buffer(1)]],
                               constant uint& n [[buffer(2)]],
                               uint t [[thread_index_in_threadgroup]]) {
  threadgroup float ab[128];
  for (uint i = t; i < 128; i += 32) ab[i] = in[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  simdgroup_float8x8 a, b, c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(a, ab, 8);
  simdgroup_load(b, ab + 64, 8);
  simdgroup_multiply_accumulate(c, a, b, c);
  simdgroup_store(c, out, 8);
}
