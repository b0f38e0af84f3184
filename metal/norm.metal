// metal/norm.metal
// embed, rms_norm, add_rms_norm: the embedding lookup, RMSNorm and the fused residual-add + RMSNorm
// (architecture.md §3.1, §7, §9.3).
//
// Math     embed:         x[t, k] = s[id, k/group] · q[id, k] + b[id, k/group],  id = tokens[t]
//          rms_norm:      out = x / sqrt(mean(x²) + eps) · w                (w already holds 1 + w, §3.1)
//          add_rms_norm:  x ← x + d;  out = x / sqrt(mean(x²) + eps) · w
// Layout   table u32[vocab, K·bits/32] (codes LSB first), s, b bf16[vocab, K/group]; tokens i32[T]; x fp32[T, H];
//          d, out bf16[T, H]; w fp32[H]
// Traffic  H=2048, per row: embed 4-bit 1.0 KB codes + 0.1 KB s,b + 8 KB x;  rms_norm x 8 KB + out 4 KB (+ w 8 KB
//          once);  add_rms_norm x 8 KB read + 8 KB written + d 4 KB + out 4 KB = 24 KB
// Work     ~4 FLOP per element: bandwidth-bound in prefill, latency-bound in decode (T=1: one threadgroup).
//          Floor on an M3 Max (400 GB/s) at T=4096: rms_norm 50 MB = 126 µs; add_rms_norm 101 MB = 252 µs
// Mapping  embed: one threadgroup per token, one thread per packed word (8 or 4 codes), float4 stores.
//          norms: one threadgroup per row; thread i holds float4 chunks i, i + threads, … (VPT of them) in
//          registers, so x is read once; the sum of squares is reduced with simd_sum, then across simdgroups
//          through threadgroup memory (summed in simdgroup order by every thread: deterministic).
//          16-byte fp32 and 8-byte bf16 (uint2) accesses.
// Checks   H % 4 == 0, H ≤ 32768; x, w 16-byte aligned; d, out 8-byte aligned. embed: bits 4 or 8,
//          group % (32/bits) == 0 (a word never straddles two groups), K % group == 0, x 16-byte aligned.
//          Token ids are validated on the host (Session::check_tokens) before they reach the device.
// Ref      cpu/norm.cpp, cpu/qmm.cpp (embed) · Test tests/metal/test_metal_ops.py (cases of tests/ops/cases.py)
// History  v1 (this), a port of cuda/norm.cu; not yet timed on Apple hardware
#include "common.h"
#include "norm_args.h"

// Four bf16 values (8 bytes, 8-byte aligned) as floats, and back.
inline float4 load_bf16x4(device const ushort* p) {
  const uint2 u = *(device const uint2*)p;
  return float4(as_type<float>(u.x << 16), as_type<float>(u.x & 0xffff0000u), as_type<float>(u.y << 16),
                as_type<float>(u.y & 0xffff0000u));
}

inline void store_bf16x4(device ushort* p, float4 v) {
  *(device uint2*)p = uint2(uint(float_to_bf16(v.x)) | (uint(float_to_bf16(v.y)) << 16),
                            uint(float_to_bf16(v.z)) | (uint(float_to_bf16(v.w)) << 16));
}

// ---- embed ----------------------------------------------------------------------------------------------------------

// Threadgroup = token t; thread i dequantises packed words i, i + threads, … of row tokens[t].
template <int BITS>
[[kernel]] void embed_rows(constant EmbedKernelArgs& args [[buffer(0)]],
                           device const uint* w [[buffer(1)]],
                           device const ushort* scales [[buffer(2)]],
                           device const ushort* biases [[buffer(3)]],
                           device const int* tokens [[buffer(4)]],
                           device float* x [[buffer(5)]],
                           uint3 tg [[threadgroup_position_in_grid]],
                           uint tid [[thread_index_in_threadgroup]],
                           uint3 threads [[threads_per_threadgroup]]) {
  constexpr int kPerWord = 32 / BITS;
  const uint words = uint(args.K / kPerWord), groups = uint(args.K / args.group);
  const uint id = uint(tokens[tg.x]);
  device const uint* wr = w + id * words;
  device const ushort* sr = scales + id * groups;
  device const ushort* br = biases + id * groups;
  device float* xr = x + tg.x * uint(args.K);
  for (uint i = tid; i < words; i += threads.x) {
    const uint k0 = i * kPerWord, g = k0 / uint(args.group);
    const float s = bf16_to_float(sr[g]), b = bf16_to_float(br[g]);
    const uint word = wr[i];
    device float4* out = (device float4*)(xr + k0);
    for (int j = 0; j < kPerWord / 4; ++j)  // x = s·q + b
      out[j] = float4(s * code<BITS>(word, 4 * j) + b, s * code<BITS>(word, 4 * j + 1) + b,
                      s * code<BITS>(word, 4 * j + 2) + b, s * code<BITS>(word, 4 * j + 3) + b);
  }
}

// ---- rms_norm, add_rms_norm -----------------------------------------------------------------------------------------

// Row = threadgroup; thread tid owns float4 chunks tid + threads·j, j < VPT. With ADD, x + d is written back to x_sum
// and normalised; otherwise x is normalised as it is (d and x_sum are not used).
template <int VPT, bool ADD>
inline void rms_norm_row(constant NormKernelArgs& args, device const float* x, device const ushort* d,
                         device float* x_sum, device const float* w, device ushort* out,
                         threadgroup float* partial, uint row, uint tid, uint threads, uint sg, uint lane,
                         uint simdgroups) {
  const uint H4 = uint(args.H) / 4, base = row * H4;
  device const float4* xr = (device const float4*)x + base;
  device const float4* wr = (device const float4*)w;
  float4 v[VPT];
  float ss = 0.0f;
  for (int j = 0; j < VPT; ++j) {
    const uint i = tid + threads * uint(j);
    v[j] = float4(0.0f);
    if (i < H4) {
      v[j] = xr[i];
      if (ADD) {
        v[j] += load_bf16x4(d + 4 * (base + i));  // x ← x + d
        ((device float4*)x_sum)[base + i] = v[j];
      }
    }
    ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
  }
  ss = simd_sum(ss);
  if (lane == 0) partial[sg] = ss;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint s = 0; s < simdgroups; ++s) total += partial[s];
  const float r = 1.0f / sqrt(total / float(args.H) + args.eps);  // 1 / sqrt(mean(x²) + eps)
  for (int j = 0; j < VPT; ++j) {
    const uint i = tid + threads * uint(j);
    if (i < H4) store_bf16x4(out + 4 * (base + i), v[j] * r * wr[i]);
  }
}

template <int VPT>
[[kernel]] void rms_norm_rows(constant NormKernelArgs& args [[buffer(0)]],
                              device const float* x [[buffer(1)]],
                              device const float* w [[buffer(2)]],
                              device ushort* out [[buffer(3)]],
                              uint3 tg [[threadgroup_position_in_grid]],
                              uint tid [[thread_index_in_threadgroup]],
                              uint3 threads [[threads_per_threadgroup]],
                              uint sg [[simdgroup_index_in_threadgroup]],
                              uint lane [[thread_index_in_simdgroup]],
                              uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[kNormMaxSimdgroups];
  rms_norm_row<VPT, false>(args, x, nullptr, nullptr, w, out, partial, tg.x, tid, threads.x, sg, lane, simdgroups);
}

template <int VPT>
[[kernel]] void add_rms_norm_rows(constant NormKernelArgs& args [[buffer(0)]],
                                  device float* x [[buffer(1)]],
                                  device const ushort* d [[buffer(2)]],
                                  device const float* w [[buffer(3)]],
                                  device ushort* out [[buffer(4)]],
                                  uint3 tg [[threadgroup_position_in_grid]],
                                  uint tid [[thread_index_in_threadgroup]],
                                  uint3 threads [[threads_per_threadgroup]],
                                  uint sg [[simdgroup_index_in_threadgroup]],
                                  uint lane [[thread_index_in_simdgroup]],
                                  uint simdgroups [[simdgroups_per_threadgroup]]) {
  threadgroup float partial[kNormMaxSimdgroups];
  rms_norm_row<VPT, true>(args, x, d, x, w, out, partial, tg.x, tid, threads.x, sg, lane, simdgroups);
}

// ---- instantiations (host names used by csrc/backend/metal/norm.cpp) ------------------------------------------------

template [[host_name("embed_q4")]] [[kernel]] decltype(embed_rows<4>) embed_rows<4>;
template [[host_name("embed_q8")]] [[kernel]] decltype(embed_rows<8>) embed_rows<8>;
template [[host_name("rms_norm_c1")]] [[kernel]] decltype(rms_norm_rows<1>) rms_norm_rows<1>;
template [[host_name("rms_norm_c2")]] [[kernel]] decltype(rms_norm_rows<2>) rms_norm_rows<2>;
template [[host_name("rms_norm_c4")]] [[kernel]] decltype(rms_norm_rows<4>) rms_norm_rows<4>;
template [[host_name("rms_norm_c8")]] [[kernel]] decltype(rms_norm_rows<8>) rms_norm_rows<8>;
template [[host_name("add_rms_norm_c1")]] [[kernel]] decltype(add_rms_norm_rows<1>) add_rms_norm_rows<1>;
template [[host_name("add_rms_norm_c2")]] [[kernel]] decltype(add_rms_norm_rows<2>) add_rms_norm_rows<2>;
template [[host_name("add_rms_norm_c4")]] [[kernel]] decltype(add_rms_norm_rows<4>) add_rms_norm_rows<4>;
template [[host_name("add_rms_norm_c8")]] [[kernel]] decltype(add_rms_norm_rows<8>) add_rms_norm_rows<8>;
