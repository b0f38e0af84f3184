// qmm.metal: y = x · Wᵀ for T > kQmvMaxT tokens (prefill), and the grouped expert GEMM of MoE prefill
// (architecture.md §3.2, §6, §9.3). Both are one simdgroup-matrix tile GEMM (gemm_tile) with two entry points.
//
// Math     qmm:       y[t, n] = Σ_k x[t, k] · W[n, k],  W[n, k] = s[n, k/group]·q[n, k] + b[n, k/group]
//          moe_gemm:  y[r, n] = x[rows[r]] · A_e[n]  for offsets[e] ≤ r < offsets[e+1] (rows == null: x[r]), or
//                     with B (SwiGLU fused) y[r, n] = silu(x[rows[r]] · A_e[n]) · (x[rows[r]] · B_e[n]).
//          W is dequantised one kQmmBN × kQmmBK tile at a time into threadgroup memory as fp32 (never a full copy),
//          x converted from bf16 to fp32 in the same way; fp32 products and accumulation (simdgroup_float8x8),
//          so the result differs from the fp32 reference only in summation order.
// Layout   W u32[E, N, K·bits/32] LSB first; s, b bf16[E, N, K/group]; x bf16[·, K]; qmm y [T, N] bf16 bits or
//          fp32 (args.y_f32, the same buffer read as float); moe_gemm y bf16[max_rows, N]; offsets i32[E+1];
//          rows i32[max_rows] (bound but unread when args.gather == 0).
// Traffic  qmm T=512, N=8192, K=2048 (q_proj, in_proj_qkv): x 2.1 MB + W 9.4 MB + y 8.4 MB = 20 MB.
//          MoE at 4K tokens: 32768 routed rows; gate+up reads x rows 134 MB, experts 302 MB, writes 33.6 MB.
// Work     qmm 2·T·N·K = 17.2 GFLOP at T=512; MoE gate+up 2·32768·1024·2048 = 137.4 GFLOP, down 68.7 GFLOP.
//          Compute-bound (≥ 800 FLOP per byte). Floor on an M3 Max (40-core GPU, ~16 TFLOP/s fp32 FMA, which
//          simdgroup_float8x8 runs at): qmm T=512 1.07 ms; MoE gate+up 8.6 ms, down 4.3 ms.
// Mapping  threadgroup = 4 simdgroups (128 threads); tile BM × 64 of y (BM = 16 or 32 token rows, 64 weight rows),
//          32 columns of K per step. Per step every thread converts at most one 8-element run of x (one 16-byte
//          load; rows past T or past the expert's rows are zero) into xs[BM][32 + 4 pad] and dequantises 16 codes
//          of one weight row (s·q + b, fp32) into ws[32][64 + 4 pad] (k-major: consecutive threads write
//          consecutive words); barrier; each simdgroup owns a 16 × BM block of the tile (2 × BM/8
//          simdgroup_float8x8 accumulators) and runs 4 k8 sub-steps of simdgroup_load from xs and ws and
//          simdgroup_multiply_accumulate. Epilogue: accumulators → threadgroup memory (reusing ws) →
//          bounds-checked, coalesced stores of y (bf16 or fp32).
//          Fused SwiGLU: tile rows 0..31 are A_e rows n0.., rows 32..63 the same rows of B_e, so a tile yields
//          32 output columns silu(g)·u. Weight rows past N repeat row N−1 and are never stored.
//          moe_gemm: the grid has ceil(max_rows/BM) + E row tiles (≥ Σ_e ceil(count_e/BM)); each threadgroup finds
//          its (expert, row range) with a threadgroup prefix sum of ceil(count_e/BM) over the device offsets and
//          exits when past the last tile: no host synchronisation. The launcher picks BM = 16 when experts average
//          fewer than 32 rows (max_rows/E), else 32; qmm uses BM = 16 for T ≤ 16, else 32.
//          Threadgroup memory: xs 4.5 KB + ws 8.5 KB (+ 28 B for the tile search) ≤ 32 KB.
// Checks   bits 4|8; group 32|64|128 (so K % 32 == 0); K % group == 0; 16-byte aligned W and x; qmm W.E == 1;
//          moe B like A; E·N·K·bits/32 < 2^31; offsets non-decreasing with offsets[E] − offsets[0] ≤ max_rows
//          (not checkable on the host).
// Ref      cpu/qmm.cpp (qmm), cpu/moe.cpp (experts) · Test tests/ops/cases.py op="qmm" (T > 8), op="moe";
//          tests/metal (harness)
// History  v1 (this)
#include "common.h"
#include "qmm_args.h"

// Tile product over all of K: xs/ws are the x and W tiles of one step; on return the BM × kQmmBN fp32 result is in
// cs (which aliases ws) with row pitch kQmmWP. The thread's duties come precomputed:
//   x run: tile row xm, columns 8·xc .. 8·xc+7 of each step, read from xrow (xm < 0: no run; !xok: zeros);
//   W run: tile row wv (k-major column of ws), codes 16·wp .. 16·wp+15 of each step, from wrow / srow / brow.
template <int BITS, int BM>
void gemm_tile(
    int K,
    int gshift,
    int xm,
    int xc,
    bool xok,
    device const ushort* xrow,
    int wv,
    int wp,
    device const uint* wrow,
    device const ushort* srow,
    device const ushort* brow,
    threadgroup float* xs,
    threadgroup float* ws,
    uint sg) {
  constexpr int SGN = 4 / (BM / 16);    // simdgroups along N
  constexpr int FN = kQmmBN / SGN / 8;  // 8×8 accumulators per simdgroup along N
  constexpr int WPR = 16 * BITS / 32;   // words of one 16-code run
  const int sm = int(sg) / SGN, sn = int(sg) % SGN;

  simdgroup_float8x8 acc[2][FN];
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < FN; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);

  for (int k0 = 0; k0 < K; k0 += kQmmBK) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every simdgroup is done with the previous step's tiles
    if (xm >= 0) {
      float v[8];
      if (xok) {
        const uint4 raw = *((device const uint4*)(xrow + k0 + 8 * xc));
        for (int h = 0; h < 4; ++h) {
          v[2 * h] = bf16_to_float(ushort(raw[h] & 0xffffu));
          v[2 * h + 1] = bf16_to_float(ushort(raw[h] >> 16));
        }
      } else {
        for (int j = 0; j < 8; ++j) v[j] = 0.0f;
      }
      for (int j = 0; j < 8; ++j) xs[xm * kQmmXP + 8 * xc + j] = v[j];
    }
    {
      const int k = k0 + 16 * wp;
      const float s = bf16_to_float(srow[k >> gshift]);
      const float b = bf16_to_float(brow[k >> gshift]);
      device const uint* src = wrow + k * BITS / 32;
      for (int i = 0; i < WPR; ++i) {
        const uint word = src[i];
        for (int j = 0; j < 32 / BITS; ++j)
          ws[(16 * wp + i * (32 / BITS) + j) * kQmmWP + wv] = fma(s, code<BITS>(word, j), b);  // W = s·q + b
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    for (int kk = 0; kk < kQmmBK; kk += 8) {
      simdgroup_float8x8 a[2];
      simdgroup_float8x8 bm[FN];
      for (int i = 0; i < 2; ++i) simdgroup_load(a[i], xs + (sm * 16 + 8 * i) * kQmmXP + kk, kQmmXP);
      for (int j = 0; j < FN; ++j) simdgroup_load(bm[j], ws + kk * kQmmWP + sn * (8 * FN) + 8 * j, kQmmWP);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < FN; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], bm[j], acc[i][j]);
    }
  }

  threadgroup_barrier(mem_flags::mem_threadgroup);  // ws is free: it becomes cs
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < FN; ++j)
      simdgroup_store(acc[i][j], ws + (sm * 16 + 8 * i) * kQmmWP + sn * (8 * FN) + 8 * j, kQmmWP);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

template <int BITS, int BM>
[[kernel]] void qmm(
    constant QmmArgs& args [[buffer(0)]],
    device const ushort* x [[buffer(1)]],
    device const uint* w [[buffer(2)]],
    device const ushort* scales [[buffer(3)]],
    device const ushort* biases [[buffer(4)]],
    device ushort* y [[buffer(5)]],
    uint3 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float xs[kQmmMaxBM * kQmmXP];
  threadgroup float ws[kQmmBK * kQmmWP];
  const int K = args.K, N = args.N, T = args.rows;
  const int n0 = int(tgp.x) * kQmmBN, m0 = int(tgp.y) * BM;

  const int xi = int(tid);  // x run: one 8-column run per thread while the tile has runs left
  const int xm = xi < BM * kQmmBK / 8 ? xi / (kQmmBK / 8) : -1;
  const int xc = xi % (kQmmBK / 8);
  const bool xok = xm >= 0 && m0 + xm < T;
  device const ushort* xrow = x + (xok ? m0 + xm : 0) * K;

  const int wv = int(tid) % kQmmBN, wp = int(tid) / kQmmBN;
  const int n = min(n0 + wv, N - 1);
  gemm_tile<BITS, BM>(K, args.gshift, xm, xc, xok, xrow, wv, wp, w + n * (K * BITS / 32), scales + n * args.groups,
                      biases + n * args.groups, xs, ws, sg);

  for (int i = int(tid); i < BM * kQmmBN; i += kQmmThreads) {
    const int m = i / kQmmBN, j = i % kQmmBN;
    if (m0 + m >= T || n0 + j >= N) continue;
    const float v = ws[m * kQmmWP + j];
    if (args.y_f32)
      ((device float*)y)[(m0 + m) * N + n0 + j] = v;
    else
      y[(m0 + m) * N + n0 + j] = float_to_bf16(v);
  }
}

// The (expert, first row, end row) of flattened row tile t, where expert e owns ceil(count_e / BM) tiles in expert
// order. All threads of the threadgroup call it; returns false for every thread when t is past the last tile.
// scratch: threadgroup int[kQmmThreads/32 + 3].
template <int BM>
bool find_tile(
    device const int* offsets,
    int E,
    int t,
    threadgroup int* scratch,
    uint tid,
    uint sg,
    uint lane,
    thread int& e,
    thread int& r0,
    thread int& r1) {
  constexpr int SG = kQmmThreads / 32;
  threadgroup int* sg_tiles = scratch;  // tiles of each simdgroup's experts in this pass
  threadgroup int* hit = scratch + SG;  // expert, first row, end row
  if (tid == 0) hit[0] = -1;
  int carry = 0;  // tiles of the experts of earlier passes
  for (int base = 0; base < E; base += kQmmThreads) {
    const int ex = base + int(tid);
    int lo = 0, hi = 0;
    if (ex < E) {
      lo = offsets[ex];
      hi = offsets[ex + 1];
    }
    const int cnt = hi > lo ? (hi - lo + BM - 1) / BM : 0;
    const int excl = simd_prefix_exclusive_sum(cnt);
    if (lane == 31) sg_tiles[sg] = excl + cnt;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int before = carry, total = carry;
    for (int s = 0; s < SG; ++s) {
      const int v = sg_tiles[s];
      if (s < int(sg)) before += v;
      total += v;
    }
    const int first = before + excl;
    if (t >= first && t < first + cnt) {
      hit[0] = ex;
      hit[1] = lo + (t - first) * BM;
      hit[2] = hi;
    }
    carry = total;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // hit visible; sg_tiles free for the next pass
  }
  e = hit[0];
  if (e < 0) return false;
  r0 = hit[1];
  r1 = min(hit[1] + BM, hit[2]);
  return true;
}

template <int BITS, int BM, bool SWIGLU>
[[kernel]] void moe_gemm(
    constant QmmArgs& args [[buffer(0)]],
    device const ushort* x [[buffer(1)]],
    device const int* offsets [[buffer(2)]],
    device const int* rows [[buffer(3)]],
    device const uint* a_w [[buffer(4)]],
    device const ushort* a_s [[buffer(5)]],
    device const ushort* a_b [[buffer(6)]],
    device const uint* b_w [[buffer(7)]],
    device const ushort* b_s [[buffer(8)]],
    device const ushort* b_b [[buffer(9)]],
    device ushort* y [[buffer(10)]],
    uint3 tgp [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float xs[kQmmMaxBM * kQmmXP];
  threadgroup float ws[kQmmBK * kQmmWP];
  threadgroup int scratch[kQmmThreads / 32 + 3];
  int e = 0, r0 = 0, r1 = 0;
  if (!find_tile<BM>(offsets, args.E, int(tgp.y), scratch, tid, sg, lane, e, r0, r1)) return;

  constexpr int OUTN = SWIGLU ? kQmmBN / 2 : kQmmBN;  // output columns per tile
  const int K = args.K, N = args.N;
  const int n0 = int(tgp.x) * OUTN;

  const int xi = int(tid);
  const int xm = xi < BM * kQmmBK / 8 ? xi / (kQmmBK / 8) : -1;
  const int xc = xi % (kQmmBK / 8);
  const bool xok = xm >= 0 && r0 + xm < r1;
  const int xr = xok ? (args.gather ? rows[r0 + xm] : r0 + xm) : 0;
  device const ushort* xrow = x + xr * K;

  // Weight row of tile row wv: A_e rows n0.., or with SwiGLU A_e rows n0..n0+31 then B_e rows n0..n0+31.
  const int wv = int(tid) % kQmmBN, wp = int(tid) / kQmmBN;
  const bool from_b = SWIGLU && wv >= OUTN;
  const int n = min(n0 + (from_b ? wv - OUTN : wv), N - 1);
  const int wr = e * N + n;
  device const uint* wrow = (from_b ? b_w : a_w) + wr * (K * BITS / 32);
  device const ushort* srow = (from_b ? b_s : a_s) + wr * args.groups;
  device const ushort* brow = (from_b ? b_b : a_b) + wr * args.groups;
  gemm_tile<BITS, BM>(K, args.gshift, xm, xc, xok, xrow, wv, wp, wrow, srow, brow, xs, ws, sg);

  for (int i = int(tid); i < BM * OUTN; i += kQmmThreads) {
    const int m = i / OUTN, j = i % OUTN;
    if (r0 + m >= r1 || n0 + j >= N) continue;
    const float g = ws[m * kQmmWP + j];
    const float v = SWIGLU ? silu_f(g) * ws[m * kQmmWP + OUTN + j] : g;  // silu(x·A_e[n]) · (x·B_e[n])
    y[(r0 + m) * N + n0 + j] = float_to_bf16(v);
  }
}

template [[host_name("qmm_q4_m16")]] [[kernel]] decltype(qmm<4, 16>) qmm<4, 16>;
template [[host_name("qmm_q4_m32")]] [[kernel]] decltype(qmm<4, 32>) qmm<4, 32>;
template [[host_name("qmm_q8_m16")]] [[kernel]] decltype(qmm<8, 16>) qmm<8, 16>;
template [[host_name("qmm_q8_m32")]] [[kernel]] decltype(qmm<8, 32>) qmm<8, 32>;
template [[host_name("moe_gemm_q4_m16")]] [[kernel]] decltype(moe_gemm<4, 16, false>) moe_gemm<4, 16, false>;
template [[host_name("moe_gemm_q4_m32")]] [[kernel]] decltype(moe_gemm<4, 32, false>) moe_gemm<4, 32, false>;
template [[host_name("moe_gemm_q8_m16")]] [[kernel]] decltype(moe_gemm<8, 16, false>) moe_gemm<8, 16, false>;
template [[host_name("moe_gemm_q8_m32")]] [[kernel]] decltype(moe_gemm<8, 32, false>) moe_gemm<8, 32, false>;
template [[host_name("moe_gemm_swiglu_q4_m16")]] [[kernel]] decltype(moe_gemm<4, 16, true>) moe_gemm<4, 16, true>;
template [[host_name("moe_gemm_swiglu_q4_m32")]] [[kernel]] decltype(moe_gemm<4, 32, true>) moe_gemm<4, 32, true>;
template [[host_name("moe_gemm_swiglu_q8_m16")]] [[kernel]] decltype(moe_gemm<8, 16, true>) moe_gemm<8, 16, true>;
template [[host_name("moe_gemm_swiglu_q8_m32")]] [[kernel]] decltype(moe_gemm<8, 32, true>) moe_gemm<8, 32, true>;
