// qmv.metal: y = x · Wᵀ for T ≤ kQmvMaxT tokens (decode), W in MLX affine 4- or 8-bit (architecture.md §3.2, §9.3);
// up to kQmvMaxSegs matrices of equal K, bits and group size that read the same x in one dispatch (qmm_multi).
//
// Math     y[t, n] = Σ_c ( s[n, g(c)] · Σ_{k∈c} q[n, k]·x[t, k]  +  b[n, g(c)] · Σ_{k∈c} x[t, k] )
//          over 16-byte chunks c of a row (32 codes at 4 bits, 16 at 8); a group holds whole chunks, so no
//          dequantised weight is formed (the MLX identity s·Σq·x + b·Σx). fp32 throughout.
// Layout   W u32[N, K·bits/32] LSB first; s, b bf16[N, K/group]; x bf16[T, K]; y [T, N] bf16 bits, or fp32 (the
//          logits: args.y_f32, the same buffer read as float).
// Traffic  T=1, 4-bit g64: N·K/2 codes + N·K/16 s,b.  8192×2048 (q_proj, in_proj_qkv): 8.39 + 1.05 = 9.44 MB;
//          lm_head 248320×2048: 254.3 + 31.8 = 286.1 MB;  512×2048 (k/v): 0.59 MB;  2048×512: 0.59 MB.
// Work     2·T·N·K FLOP, ≤ 4 FLOP per weight byte at T=1: bandwidth-bound.  Floor on an M3 Max (400 GB/s):
//          8192×2048 23.6 µs;  lm_head 715 µs;  the ≤ 1 MB matrices are dispatch/latency-bound (~1.5 µs).
// Mapping  threadgroup = 8 simdgroups × 4 weight rows = 32 rows of one matrix (threadgroups of the matrices of a
//          qmm_multi dispatch follow each other: args.tg0). x is staged as fp32 in threadgroup memory, one slab of
//          KS columns at a time (T·KS ≤ 4096 floats: one slab for T=1, K ≤ 4096), float4 slots swizzled (slot XOR
//          row of 32 floats mod 8, so the lanes of a simdgroup reading consecutive chunks spread over the banks).
//          Lane l of a simdgroup reads chunks l, l+32, … of the slab for its 4 rows (four uint4 loads in flight),
//          decodes the codes in registers, forms Σq·x per row and Σx once for the 4 rows; simd_sum reduces over
//          the lanes in a fixed order (deterministic, no atomics). Rows past N repeat row N−1 and are never stored.
// Checks   bits 4|8; group 32|64|128; K % group == 0; W.E == 1; 16-byte aligned W and x; N·chunks < 2^31.
//          Scales may be negative.
// Ref      cpu/qmm.cpp (qmv, qmm) · Test tests/ops/cases.py op="qmm" (T ≤ 8), op="qmm_multi"; tests/metal (harness)
// History  v1 · v2 (2026-12-06) qmv_resid and qmv_fold, the port of CUDA's switch norm_fold (qmv.cu v7): a decode
//          token's post-mixer residual add in the output projection's GEMV, its RMSNorm folded into the router's.
#include "common.h"
#include "qmm_args.h"

// float4 slot of element e (e % 4 == 0) of a staged x row: rows of 32 floats, slot (e/4 mod 8) XOR (row mod 8).
inline int xslot(int e) {
  const int row = e >> 5;
  return row * 8 + (((e >> 2) ^ row) & 7);
}

// The sums Σ_k W[n, k]·x[t, k] of a simdgroup's kQmvRows rows n0.. of one matrix, each lane's share (simd_sum
// completes them). Every thread of the threadgroup calls it: it stages x in slabs between threadgroup barriers.
template <int T>
struct QmvAcc {
  float v[kQmvRows][T];
};

template <int BITS, int T>
inline QmvAcc<T> qmv_sums(constant QmvArgs& args, device const ushort* x, device const uint* w,
                          device const ushort* sc, device const ushort* bi, int N, int n0, threadgroup float* xs,
                          uint tid, uint lane) {
  constexpr int EPC = 128 / BITS;  // codes per 16-byte chunk
  constexpr int PW = 32 / BITS;    // codes per word
  const int K = args.K, KS = args.KS;
  device const uint4* w4 = (device const uint4*)w;
  int row[kQmvRows];  // rows past N repeat row N-1; their sums are never stored
  for (int r = 0; r < kQmvRows; ++r) row[r] = min(n0 + r, N - 1);

  QmvAcc<T> acc;
  for (int r = 0; r < kQmvRows; ++r)
    for (int t = 0; t < T; ++t) acc.v[r][t] = 0.0f;

  threadgroup float4* xs4 = (threadgroup float4*)xs;  // [T][KS/4], swizzled
  for (int k0 = 0; k0 < K; k0 += KS) {
    const int ks = min(KS, K - k0);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with the previous slab

    // Stage x[:, k0 .. k0+ks) as fp32, 8 elements (one 16-byte load) per thread and step.
    const int per_row = ks / 8;
    for (int i = int(tid); i < T * per_row; i += kQmvThreads) {
      const int t = i / per_row, e = (i - t * per_row) * 8;
      const uint4 raw = *((device const uint4*)(x + t * K + k0 + e));
      float v[8];
      for (int h = 0; h < 4; ++h) {
        v[2 * h] = bf16_to_float(ushort(raw[h] & 0xffffu));
        v[2 * h + 1] = bf16_to_float(ushort(raw[h] >> 16));
      }
      xs4[t * (KS / 4) + xslot(e)] = float4(v[0], v[1], v[2], v[3]);
      xs4[t * (KS / 4) + xslot(e + 4)] = float4(v[4], v[5], v[6], v[7]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const int c0 = k0 / EPC;  // first chunk of the slab within a row
    for (int c = int(lane); c < ks / EPC; c += 32) {
      uint4 q[kQmvRows];
      float s[kQmvRows], b[kQmvRows];
      for (int r = 0; r < kQmvRows; ++r) {
        const int g = row[r] * args.groups + ((c0 + c) >> args.gshift);
        q[r] = w4[row[r] * args.chunks + c0 + c];
        s[r] = bf16_to_float(sc[g]);
        b[r] = bf16_to_float(bi[g]);
      }
      float d[kQmvRows][T];  // Σ q·x over the chunk
      float xsum[T];         // Σ x over the chunk
      for (int t = 0; t < T; ++t) {
        xsum[t] = 0.0f;
        for (int r = 0; r < kQmvRows; ++r) d[r][t] = 0.0f;
      }
      for (int wi = 0; wi < 4; ++wi) {
        float v[kQmvRows][PW];
        for (int r = 0; r < kQmvRows; ++r)
          for (int j = 0; j < PW; ++j) v[r][j] = code<BITS>(q[r][wi], j);
        const int e = c * EPC + wi * PW;
        for (int t = 0; t < T; ++t) {
          float xv[PW];
          for (int h = 0; h < PW / 4; ++h) {
            const float4 f = xs4[t * (KS / 4) + xslot(e + 4 * h)];
            xv[4 * h] = f.x;
            xv[4 * h + 1] = f.y;
            xv[4 * h + 2] = f.z;
            xv[4 * h + 3] = f.w;
          }
          for (int j = 0; j < PW; ++j) xsum[t] += xv[j];
          for (int r = 0; r < kQmvRows; ++r)
            for (int j = 0; j < PW; ++j) d[r][t] = fma(v[r][j], xv[j], d[r][t]);
        }
      }
      for (int r = 0; r < kQmvRows; ++r)
        for (int t = 0; t < T; ++t)
          acc.v[r][t] = fma(s[r], d[r][t], fma(b[r], xsum[t], acc.v[r][t]));  // s·Σq·x + b·Σx
    }
  }
  return acc;
}

template <int BITS, int T>
[[kernel]] void qmv(
    constant QmvArgs& args [[buffer(0)]],
    device const ushort* x [[buffer(1)]],
    device const uint* w0 [[buffer(2)]],
    device const ushort* s0 [[buffer(3)]],
    device const ushort* b0 [[buffer(4)]],
    device ushort* y0 [[buffer(5)]],
    device const uint* w1 [[buffer(6)]],
    device const ushort* s1 [[buffer(7)]],
    device const ushort* b1 [[buffer(8)]],
    device ushort* y1 [[buffer(9)]],
    device const uint* w2 [[buffer(10)]],
    device const ushort* s2 [[buffer(11)]],
    device const ushort* b2 [[buffer(12)]],
    device ushort* y2 [[buffer(13)]],
    device const uint* w3 [[buffer(14)]],
    device const ushort* s3 [[buffer(15)]],
    device const ushort* b3 [[buffer(16)]],
    device ushort* y3 [[buffer(17)]],
    threadgroup float* xs [[threadgroup(0)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  // The matrix this threadgroup works on.
  int si = 0;
  for (int i = 1; i < args.nseg; ++i)
    if (int(tg) >= args.tg0[i]) si = i;
  device const uint* w = si == 0 ? w0 : si == 1 ? w1 : si == 2 ? w2 : w3;
  device const ushort* sc = si == 0 ? s0 : si == 1 ? s1 : si == 2 ? s2 : s3;
  device const ushort* bi = si == 0 ? b0 : si == 1 ? b1 : si == 2 ? b2 : b3;
  device ushort* y = si == 0 ? y0 : si == 1 ? y1 : si == 2 ? y2 : y3;
  const int N = args.N[si];
  const int n0 = (int(tg) - args.tg0[si]) * kQmvRowsPerGroup + int(sg) * kQmvRows;
  const QmvAcc<T> acc = qmv_sums<BITS, T>(args, x, w, sc, bi, N, n0, xs, tid, lane);

  for (int r = 0; r < kQmvRows; ++r)
    for (int t = 0; t < T; ++t) {
      const float v = simd_sum(acc.v[r][t]);
      if (lane == 0 && n0 + r < N) {
        if (args.y_f32)
          ((device float*)y)[t * N + n0 + r] = v;
        else
          y[t * N + n0 + r] = float_to_bf16(v);
      }
    }
}

// Switch norm_fold's producer (one token, one matrix): x += W·y (fp32 x [N]) instead of writing y, xw = x ⊙ nw (bf16),
// and the threadgroup's Σx² over its rows to parts[tg].
template <int BITS>
[[kernel]] void qmv_resid(
    constant QmvArgs& args [[buffer(0)]],
    device const ushort* y [[buffer(1)]],
    device const uint* w [[buffer(2)]],
    device const ushort* sc [[buffer(3)]],
    device const ushort* bi [[buffer(4)]],
    device float* x [[buffer(5)]],
    device const float* nw [[buffer(6)]],
    device ushort* xw [[buffer(7)]],
    device float* parts [[buffer(8)]],
    threadgroup float* xs [[threadgroup(0)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float ssg[kQmvSimdgroups];
  const int N = args.N[0], n0 = int(tg) * kQmvRowsPerGroup + int(sg) * kQmvRows;
  const QmvAcc<1> acc = qmv_sums<BITS, 1>(args, y, w, sc, bi, N, n0, xs, tid, lane);
  float ss = 0.0f;
  for (int r = 0; r < kQmvRows; ++r) {
    const float v = simd_sum(acc.v[r][0]);
    if (lane == 0 && n0 + r < N) {
      const float nx = x[n0 + r] + v;  // x ← x + W·y
      x[n0 + r] = nx;
      xw[n0 + r] = float_to_bf16(nx * nw[n0 + r]);
      ss += nx * nx;
    }
  }
  if (lane == 0) ssg[sg] = ss;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    float s = 0.0f;
    for (int i = 0; i < kQmvSimdgroups; ++i) s += ssg[i];
    parts[tg] = s;
  }
}

// Switch norm_fold's consumer (one token, one matrix): y = rms_norm(xf)·nw · Wᵀ as r·(xw · Wᵀ), with xw = xf ⊙ nw
// (bf16, from qmv_resid) and r = 1 / sqrt(Σ parts / K + eps) from its threadgroups' partial sums of xf², which every
// threadgroup adds in the same order; m gets rms_norm(xf)·nw (bf16 [K]), each threadgroup its share, for the kernels
// after this one (the router's m, for the experts).
template <int BITS>
[[kernel]] void qmv_fold(
    constant QmvArgs& args [[buffer(0)]],
    device const ushort* xw [[buffer(1)]],
    device const uint* w [[buffer(2)]],
    device const ushort* sc [[buffer(3)]],
    device const ushort* bi [[buffer(4)]],
    device ushort* y [[buffer(5)]],
    device const float* parts [[buffer(6)]],
    device const float* xf [[buffer(7)]],
    device const float* nw [[buffer(8)]],
    device ushort* m [[buffer(9)]],
    threadgroup float* xs [[threadgroup(0)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint groups [[threadgroups_per_grid]]) {
  threadgroup float rs;
  if (sg == 0) {
    float s = 0.0f;
    for (int i = int(lane); i < args.nparts; i += 32) s += parts[i];
    s = simd_sum(s);
    if (lane == 0) rs = 1.0f / sqrt(s / float(args.K) + args.eps);  // 1 / sqrt(mean(x²) + eps)
  }
  const int N = args.N[0], n0 = int(tg) * kQmvRowsPerGroup + int(sg) * kQmvRows;
  const QmvAcc<1> acc = qmv_sums<BITS, 1>(args, xw, w, sc, bi, N, n0, xs, tid, lane);  // its barriers publish rs
  const float r = rs;
  for (int i = int(tg * kQmvThreads + tid); i < args.K; i += int(groups) * kQmvThreads)
    m[i] = float_to_bf16(xf[i] * r * nw[i]);
  for (int k = 0; k < kQmvRows; ++k) {
    const float v = simd_sum(acc.v[k][0]) * r;
    if (lane == 0 && n0 + k < N) {
      if (args.y_f32)
        ((device float*)y)[n0 + k] = v;
      else
        y[n0 + k] = float_to_bf16(v);
    }
  }
}

template [[host_name("qmv_q4_t1")]] [[kernel]] decltype(qmv<4, 1>) qmv<4, 1>;
template [[host_name("qmv_q4_t2")]] [[kernel]] decltype(qmv<4, 2>) qmv<4, 2>;
template [[host_name("qmv_q4_t3")]] [[kernel]] decltype(qmv<4, 3>) qmv<4, 3>;
template [[host_name("qmv_q4_t4")]] [[kernel]] decltype(qmv<4, 4>) qmv<4, 4>;
template [[host_name("qmv_q4_t5")]] [[kernel]] decltype(qmv<4, 5>) qmv<4, 5>;
template [[host_name("qmv_q4_t6")]] [[kernel]] decltype(qmv<4, 6>) qmv<4, 6>;
template [[host_name("qmv_q4_t7")]] [[kernel]] decltype(qmv<4, 7>) qmv<4, 7>;
template [[host_name("qmv_q4_t8")]] [[kernel]] decltype(qmv<4, 8>) qmv<4, 8>;
template [[host_name("qmv_q8_t1")]] [[kernel]] decltype(qmv<8, 1>) qmv<8, 1>;
template [[host_name("qmv_q8_t2")]] [[kernel]] decltype(qmv<8, 2>) qmv<8, 2>;
template [[host_name("qmv_q8_t3")]] [[kernel]] decltype(qmv<8, 3>) qmv<8, 3>;
template [[host_name("qmv_q8_t4")]] [[kernel]] decltype(qmv<8, 4>) qmv<8, 4>;
template [[host_name("qmv_q8_t5")]] [[kernel]] decltype(qmv<8, 5>) qmv<8, 5>;
template [[host_name("qmv_q8_t6")]] [[kernel]] decltype(qmv<8, 6>) qmv<8, 6>;
template [[host_name("qmv_q8_t7")]] [[kernel]] decltype(qmv<8, 7>) qmv<8, 7>;
template [[host_name("qmv_q8_t8")]] [[kernel]] decltype(qmv<8, 8>) qmv<8, 8>;
template [[host_name("qmv_resid_q4")]] [[kernel]] decltype(qmv_resid<4>) qmv_resid<4>;
template [[host_name("qmv_resid_q8")]] [[kernel]] decltype(qmv_resid<8>) qmv_resid<8>;
template [[host_name("qmv_fold_q4")]] [[kernel]] decltype(qmv_fold<4>) qmv_fold<4>;
template [[host_name("qmv_fold_q8")]] [[kernel]] decltype(qmv_fold<8>) qmv_fold<8>;
