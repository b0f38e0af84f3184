// qmv.cu: y = x · Wᵀ for T ≤ kQmvShortMaxT tokens (decode; a short prompt tail), W in MLX affine 4- or 8-bit
// (architecture.md §3.2, §9.3).
//
// Math     y[t, n] = Σ_c ( s[n, g(c)] · Σ_{k∈c} q[n, k]·x[t, k]  +  b[n, g(c)] · Σ_{k∈c} x[t, k] )
//          over 16-byte chunks c of a row (32 codes at 4 bits, 16 at 8); a group holds whole chunks, so no
//          dequantised weight is formed. 4-bit codes decode as 128 + q (gemm.cuh), the offset moves into the
//          bias term: s·Σ(128+q)·x + (b − 128·s)·Σx. fp32 throughout. 9 ≤ T ≤ 16 (qmv_mma_kernel, below): W
//          dequantised to bf16 in registers, products on tensor cores with fp32 accumulation.
// Layout   W u32[N, K·bits/32] LSB first; s, b bf16[N, K/group]; x bf16[T, K]; y [T, N] bf16, or fp32 (logits)
// Traffic  T=1, 4-bit g64: N·K/2 codes + N·K/16 s,b.  8192×2048 (q_proj, in_proj_qkv): 8.39 + 1.05 = 9.44 MB;
//          lm_head 248320×2048: 254.3 + 31.8 = 286.1 MB;  512×2048 (k/v): 0.59 MB;  2048×512: 0.59 MB.
// Work     2·T·N·K FLOP, ≤ 4 FLOP per weight byte at T=1 (64 at T=16): bandwidth-bound.  Floor @ 4.8 TB/s
//          (4.25 measured copy): 8192×2048 2.0 µs (2.2);  lm_head 59.6 µs (67.3);  the ≤ 1 MB matrices are
//          launch/latency-bound (~2 µs).
// Mapping  block = 8 warps; a warp owns 4 rows and a 1/split share of K (split 1..8 so that small N still fills
//          132 SMs): lane l reads 16-byte chunks c = 32·sp + l + 32·split·i of all 4 rows (512 coalesced bytes per
//          row per warp step), issues up to 8 chunk loads before the first use and before x is staged. x is staged
//          once per block into shared memory as fp32, swizzled (float4 slot XOR row mod 8: quarter-warps reading
//          8 consecutive chunks hit 8 distinct bank groups), with Σx per chunk precomputed; one x read serves 4
//          rows (switch qmv_dp4a, T = 1: x staged as 16-bit integers, the codes multiplied by dp4a; below). Codes →
//          floats by byte permute (no I2F). Warp shuffle sums, then a fixed-order sum over the
//          split warps in shared memory (deterministic, no atomics).
// Checks   bits 4|8; group 32|64|128; K % group == 0; W.E == 1; 16-byte aligned W and x; T·K·4 + T·K·bits/32 bytes
//          of x staging fit in shared memory (T=1 K=2048: 8.3 KB; T=8 K=4096: 132 KB). Scales may be negative.
//          qmv_mma_kernel: K % 64 == 0 (else the tile GEMMs take 9 ≤ T ≤ 16).
// Ref      cpu/qmm.cpp (qmv, qmm) · Test tests/ops (op qmm and qmm_multi, T ≤ 16)
// History  v1 one matrix per launch · v2 up to 4 matrices sharing x in one launch (the GDN and attention input
//          projections: 3 launches fewer per layer) · v3 (2026-12-01) T = 1 on qmv_stream_kernel (switch
//          qmv_stream: persistent warps, two units in flight): +2.6 % decode at 4K; weights loaded before the PDL
//          wait. Tried and removed: the input RMSNorm computed in the prologue of every block (−14.7 % decode).
//          v4 (2026-12-02) 9 ≤ T ≤ 16 on qmv_mma_kernel (switch qmv_mma), replacing two passes of qmv_kernel
//          (T FMAs per code in fp32: 2.15 ms per pass over the dense weights of a 14-token forward).
//          v5 (2026-12-04) qmv_norm: the streaming kernel staged rms_norm(x)·w from the fp32 residual itself, so
//          the input projections and the lm_head needed no norm kernel: +1.35 % at 4K against its own build with
//          the switch off (H200, v14). Removed in session 42 (benchmarks/NOTES.md): the build without its code
//          decoded 0.4 % faster at 4K than the build with it (H200, v18). Also tried and removed: the post-mixer
//          residual add and norm in the router the same way (+0.6 %, NOTES.md v14).
//          v6 (2026-12-05) qmv_dp4a (switch): one token's dot products (both kernels) on dp4a, x staged in
//          16-bit fixed point per code chunk (x16.cuh: exact for every element within 2^7 of its chunk's largest),
//          ~0.75 instructions per 4-bit code instead of ~2.4.
//          v7 (current, 2026-12-06) norm_fold (switch): a decode token's RMSNorm folded in without computing it here.
//          rms_norm(x)·w·Wᵀ = r·((x ⊙ w)·Wᵀ) with r = 1/sqrt(mean(x²) + eps) one scalar, so the streaming kernel
//          stages x ⊙ w and scales its sums by r. Both come from the kernel that updated x (qmv_kernel<…, RESID>:
//          the mixer's output projection adding into the residual): x ⊙ w in bf16, and Σx² per block, which the
//          GEMV's last warp sums while the others stage. Unlike v5 no block reduces x itself. Used for the router
//          (moe.cu); the input projections' norm folded the same way measured +0.4 % (benchmarks/NOTES.md, session
//          43: the norm kernel lets the GEMV's blocks onto the SMs early). Tried and removed (session 45, NOTES.md):
//          the input projections on one block per SM that bulk-copies its whole share of the weights into shared
//          memory before its PDL wait (qmv_stage): decode −4.4 % at 4K; the burst delays the norm kernel before it.
#include <utility>

#include "backend/cuda/gemm.cuh"
#include "backend/cuda/ops.cuh"
#include "backend/cuda/x16.cuh"

namespace lily::cuda {

namespace {

constexpr int kWarps = 8;  // warps per block
constexpr int kRows = 4;   // weight rows per warp

// Static shared memory of qmv_kernel<·, T> (the per-warp sums `red`).
constexpr size_t red_bytes(int T) { return sizeof(float) * kWarps * kRows * T; }

constexpr int kMaxSegs = kQmvMaxMatrices;  // matrices sharing x in one launch (qmv_multi; backend/checks.h)

struct QmvSeg {
  const uint32_t* w;   // [N, K·bits/32]
  const uint16_t* s;   // [N, groups]
  const uint16_t* b;   // [N, groups]
  void* y;             // [T, N]
  int N;
  int block0;          // first block of this matrix (qmv_kernel)
  int row0;            // first row of this matrix among all the launch's rows (qmv_stream_kernel)
};

struct QmvParams {
  QmvSeg seg[kMaxSegs];
  int nseg;
  const bf16* x;       // [T, K]
  int K;
  int chunks;          // 16-byte chunks per weight row
  int groups;          // groups per row
  int gshift;          // chunk → group: c >> gshift
  int split_log;       // log2 of the warps sharing one row set (K split)
  int rows;            // rows of all matrices together
  bool y_f32;
  // Switch norm_fold, qmv_stream_kernel<…, FOLD>: the GEMV of rms_norm(xf)·nw with x = xf ⊙ nw (bf16, written by
  // the kernel that last updated xf): every dot product scaled by r = 1 / sqrt(Σ parts / K + eps), parts[nparts]
  // that kernel's per-block Σxf². m, if set, gets rms_norm(xf)·nw (bf16 [K]).
  const float* parts;
  int nparts;
  float eps;
  const float* xf;
  const float* nw;
  bf16* m;
  // qmv_kernel<…, RESID> (T = 1, one matrix): resid += y (fp32 [N]) instead of writing y, xw = resid ⊙ w (bf16),
  // and block b's Σ resid² over its rows to ss[b].
  float* resid;
  const float* w;
  bf16* xw;
  float* ss;
};

// float4 slot of element e (e % 4 == 0) in a swizzled fp32 x row: rows of 32 floats, slot (e/4 mod 8) XOR (row mod 8).
__device__ __forceinline__ int xslot(int e) {
  const int row = e >> 5;
  return row * 8 + (((e >> 2) ^ row) & 7);
}

// The matrix of launch row `row` (the launch's matrices side by side), and its row n there.
__device__ __forceinline__ const QmvSeg& locate_row(const QmvParams& p, int row, int& n) {
  int si = 0;
#pragma unroll
  for (int i = 1; i < kMaxSegs; ++i)
    if (i < p.nseg && row >= p.seg[i].row0) si = i;
  n = row - p.seg[si].row0;
  return p.seg[si];
}

// Stages x for the block: swizzled fp32 (xslot) and Σx per 16-byte chunk of codes.
template <int BITS, int T>
__device__ __forceinline__ void stage_x(const QmvParams& p, float4* xs, float* xsum) {
  constexpr int kEpc = 128 / BITS;
  const int K4 = p.K / 4, C = p.chunks;
  // Stage x as swizzled fp32 and Σx per chunk; one thread per (t, chunk).
  for (int i = threadIdx.x; i < T * C; i += blockDim.x) {
    const int t = i / C, c = i - t * C;
    const bf16* src = p.x + size_t(t) * p.K + c * kEpc;
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < kEpc / 8; ++v) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(src) + v);
      const float2 f0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
      const float2 f1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
      const float2 f2 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.z));
      const float2 f3 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.w));
      sum += ((f0.x + f0.y) + (f1.x + f1.y)) + ((f2.x + f2.y) + (f3.x + f3.y));
      const int e = c * kEpc + 8 * v;
      xs[t * K4 + xslot(e)] = make_float4(f0.x, f0.y, f1.x, f1.y);
      xs[t * K4 + xslot(e + 4)] = make_float4(f2.x, f2.y, f3.x, f3.y);
    }
    xsum[t * C + c] = sum;
  }
}

// Switch norm_fold: r = 1 / sqrt(mean(xf²) + eps) from the producer's partial sums, by the block's last warp (all
// its loads in flight at once), into *r (read after the block's next barrier). Every block sums in the same order.
__device__ __forceinline__ void fold_scale(const QmvParams& p, float* r) {
  if (threadIdx.x < blockDim.x - 32) return;
  const int lane = threadIdx.x & 31;
  float v[kNormMaxParts / 32];
#pragma unroll
  for (int j = 0; j < kNormMaxParts / 32; ++j) v[j] = lane + 32 * j < p.nparts ? p.parts[lane + 32 * j] : 0.0f;
  float s = 0.0f;
#pragma unroll
  for (int j = 0; j < kNormMaxParts / 32; ++j) s += v[j];
  s = warp_sum(s);
  if (lane == 0) *r = 1.0f / sqrtf(s / float(p.K) + p.eps);
}

// Switch norm_fold's producer: the sum over warp 0 of its lanes' ss (the rows of the block are warp 0's) to *out.
__device__ __forceinline__ void warp0_parts(float ss, float* out) {
  if (threadIdx.x >= 32) return;
  ss = warp_sum(ss);
  if (threadIdx.x == 0) *out = ss;
}

// ---- switch qmv_dp4a: x staged in 16-bit fixed point (x16.cuh), the dot products on dp4a (T = 1) -----------------
// X16 (switch qmv_dp4a, T = 1): x staged as x16 (x16.cuh), the dot products on dp4a.
// RESID (T = 1): p.resid += y, p.xw = p.resid ⊙ p.w, and the block's Σ resid² to p.ss (norm_fold's producer).
template <int BITS, int T, bool X16 = false, bool RESID = false>
__global__ void __launch_bounds__(kWarps * 32) qmv_kernel(const QmvParams p) {
  using Q = QCodes<BITS>;
  static_assert(!X16 || T == 1, "x16 staging holds one row");
  static_assert(!RESID || T == 1, "the residual add takes one row");
  constexpr int kEpc = 128 / BITS;           // codes per 16-byte chunk
  constexpr int kPW = Q::kPerWord;           // codes per word
  constexpr int kUnroll = T <= 2 ? 2 : 1;    // warp steps whose loads are issued together
  extern __shared__ float4 xs[];             // [T][K/4] swizzled fp32 x (X16: x16 slots), then xsum fp32 [T][chunks]
  __shared__ float red[kWarps][kRows * T];   // per-warp row sums

  const int K4 = p.K / 4, C = p.chunks;
  float* xsum = X16 ? reinterpret_cast<float*>(xs + C * kX16Slots<BITS>) : reinterpret_cast<float*>(xs + T * K4);
  float* xd = xsum + C;  // X16
  uint4* xi = reinterpret_cast<uint4*>(xs);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int split = 1 << p.split_log;
  const int sp = warp & (split - 1), rg = warp >> p.split_log;
  const int rows_per_block = (kWarps >> p.split_log) * kRows;
  int si = 0;  // the matrix this block works on
#pragma unroll
  for (int i = 1; i < kMaxSegs; ++i)
    if (i < p.nseg && int(blockIdx.x) >= p.seg[i].block0) si = i;
  const QmvSeg& sg = p.seg[si];
  const int block = blockIdx.x - sg.block0;
  const int n0 = block * rows_per_block + rg * kRows;
  const bool active = n0 < sg.N;
  const int step = 32 * split;

  const uint4* w4 = reinterpret_cast<const uint4*>(sg.w);
  int row[kRows];  // rows past N repeat row N-1; their sums are never stored
#pragma unroll
  for (int r = 0; r < kRows; ++r) row[r] = min(n0 + r, sg.N - 1);

  uint4 q[kUnroll][kRows];
  uint16_t sv[kUnroll][kRows], bv[kUnroll][kRows];
  auto load = [&](int base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * step + lane;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        if (c < C) {
          const int g = row[r] * p.groups + (c >> p.gshift);
          q[u][r] = __ldg(w4 + row[r] * C + c);
          sv[u][r] = __ldg(sg.s + g);
          bv[u][r] = __ldg(sg.b + g);
        }
      }
    }
  };

  float acc[kRows][T];
#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[r][t] = 0.0f;

  auto compute = [&](int base) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = base + u * step + lane;
      if (c >= C) continue;
      if constexpr (X16) {  // Σ q·x16 in int32, then s·xd·Σ + b·Σx
        const uint4* qp[kRows];
#pragma unroll
        for (int r = 0; r < kRows; ++r) qp[r] = &q[u][r];
        int tot[kRows];
        x16_dots<BITS, kRows>(xi, c, qp, tot);
        const float dc = xd[c], xsc = xsum[c];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          acc[r][0] =
              fmaf(bf16_bits_to_f(sv[u][r]) * dc, float(tot[r]), fmaf(bf16_bits_to_f(bv[u][r]), xsc, acc[r][0]));
        continue;
      }
      const int e0 = c * kEpc;
      float d[kRows][T];
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int t = 0; t < T; ++t) d[r][t] = 0.0f;
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        float v[kRows][kPW];
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const uint32_t word = wi == 0 ? q[u][r].x : wi == 1 ? q[u][r].y : wi == 2 ? q[u][r].z : q[u][r].w;
          Q::decode(word, v[r]);
        }
#pragma unroll
        for (int t = 0; t < T; ++t) {
          float xv[kPW];
#pragma unroll
          for (int h = 0; h < kPW / 4; ++h) {
            const float4 f = xs[t * K4 + xslot(e0 + wi * kPW + 4 * h)];
            xv[4 * h] = f.x;
            xv[4 * h + 1] = f.y;
            xv[4 * h + 2] = f.z;
            xv[4 * h + 3] = f.w;
          }
#pragma unroll
          for (int r = 0; r < kRows; ++r)
#pragma unroll
            for (int j = 0; j < kPW; ++j) d[r][t] = fmaf(v[r][j], xv[j], d[r][t]);  // Σ (kOffset + q)·x
        }
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float s = bf16_bits_to_f(sv[u][r]);
        const float b = bf16_bits_to_f(bv[u][r]) - Q::kOffset * s;
#pragma unroll
        for (int t = 0; t < T; ++t) acc[r][t] = fmaf(s, d[r][t], fmaf(b, xsum[t * C + c], acc[r][t]));
      }
    }
  };

  // RESID: thread i < rows_per_block adds into row i of the block; its norm weight before the wait, x after it
  const int rn = block * rows_per_block + threadIdx.x;
  const bool rrow = RESID && threadIdx.x < rows_per_block && rn < sg.N;
  float r_w = 0.0f, r_x = 0.0f;

  const int first = sp * 32;
  pdl_trigger();
  if (active) load(first);  // the weight stream starts before x is staged (and before the previous kernel is done)
  if (rrow) r_w = __ldg(p.w + rn);
  pdl_wait();
  if (rrow) r_x = p.resid[rn];

  if constexpr (X16)
    stage_x16<BITS>(p.x, p.chunks, xi, xsum, xd);
  else
    stage_x<BITS, T>(p, xs, xsum);
  __syncthreads();

  if (active) {
    for (int base = first; base < C; base += step * kUnroll) {
      if (base != first) load(base);
      compute(base);
    }
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r)
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float v = warp_sum(acc[r][t]);
      if (lane == 0) red[warp][r * T + t] = v;
    }
  __syncthreads();

  float ss = 0.0f;  // RESID
  for (int i = threadIdx.x; i < rows_per_block * T; i += blockDim.x) {
    const int t = i / rows_per_block, lr = i - t * rows_per_block;  // consecutive threads, consecutive rows
    const int n = block * rows_per_block + lr;
    if (n >= sg.N) continue;
    const int g = lr / kRows, r = lr - g * kRows;
    float v = 0.0f;
    for (int s = 0; s < split; ++s) v += red[(g << p.split_log) + s][r * T + t];
    if constexpr (RESID) {  // T = 1, rows_per_block ≤ 32: i is this thread's row rn
      v += r_x;  // x ← x + y
      p.resid[n] = v;
      p.xw[n] = __float2bfloat16(v * r_w);
      ss += v * v;
    } else if (p.y_f32) {
      static_cast<float*>(sg.y)[size_t(t) * sg.N + n] = v;
    } else {
      static_cast<bf16*>(sg.y)[size_t(t) * sg.N + n] = __float2bfloat16(v);
    }
  }
  if constexpr (RESID) warp0_parts(ss, p.ss + blockIdx.x);  // rows_per_block·T ≤ 32: warp 0's threads
}

// ---- the streaming decode GEMV (switch qmv_stream): T = 1 ---------------------------------------------------------
// Persistent: kStreamBlocksPerSm blocks per SM stage x once; warp w of the grid takes units (RPU rows) w, w + warps,
// … over all the launch's rows, and loads unit u + warps before it computes unit u, so every warp keeps two units'
// codes in flight and no block waits for a second wave. Lane l holds chunks l + 32·i (i < CPL) of each row; the x
// values of a chunk are read once for the unit's rows. RPU·CPL = 4 16-byte loads per lane and unit (2 rows of 2
// chunks at K = 2048 in 4 bits; 1 row of 4 chunks at K = 4096). Same arithmetic as qmv_kernel.
constexpr int kStreamWarps = 8;
constexpr int kStreamBlocksPerSm = 2;

template <int RPU, int CPL>
struct StreamUnit {
  uint4 q[RPU][CPL];
  uint16_t s[RPU][CPL], b[RPU][CPL];
};

// FOLD (switch norm_fold): x = xf ⊙ nw, the sums scaled by r (fold_scale); p.m, if set, ← rms_norm(xf)·nw.
template <int BITS, int CPL, bool X16, bool FOLD = false>
__global__ void __launch_bounds__(kStreamWarps * 32, kStreamBlocksPerSm) qmv_stream_kernel(const QmvParams p) {
  using Q = QCodes<BITS>;
  constexpr int kEpc = 128 / BITS, kPW = Q::kPerWord, RPU = 4 / CPL;
  extern __shared__ float4 xs[];  // [K/4] swizzled fp32 x, or (X16) the x16 slots; then Σx fp32 [chunks], (X16) xd
  const int C = p.chunks;
  float* xsum = X16 ? reinterpret_cast<float*>(xs + C * kX16Slots<BITS>) : reinterpret_cast<float*>(xs + p.K / 4);
  float* xd = xsum + C;
  uint4* xi = reinterpret_cast<uint4*>(xs);
  __shared__ float r_fold;  // FOLD
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * kStreamWarps, units = p.rows / RPU;
  int u = blockIdx.x * kStreamWarps + (threadIdx.x >> 5);

  auto load = [&](int unit, StreamUnit<RPU, CPL>& U) {
#pragma unroll
    for (int r = 0; r < RPU; ++r) {
      int n;
      const QmvSeg& sg = locate_row(p, RPU * unit + r, n);
      const uint4* w4 = reinterpret_cast<const uint4*>(sg.w) + size_t(n) * C;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        const int c = lane + 32 * i, g = n * p.groups + (c >> p.gshift);
        U.q[r][i] = __ldg(w4 + c);
        U.s[r][i] = __ldg(sg.s + g);
        U.b[r][i] = __ldg(sg.b + g);
      }
    }
  };
  auto compute = [&](int unit, const StreamUnit<RPU, CPL>& U) {
    float acc[RPU] = {};
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = lane + 32 * i, e0 = c * kEpc;
      if constexpr (X16) {  // Σ q·x16 in int32, then s·xd·Σ + b·Σx
        const uint4* q[RPU];
#pragma unroll
        for (int r = 0; r < RPU; ++r) q[r] = &U.q[r][i];
        int tot[RPU];
        x16_dots<BITS, RPU>(xi, c, q, tot);
        const float d = xd[c], xsc = xsum[c];
#pragma unroll
        for (int r = 0; r < RPU; ++r)
          acc[r] = fmaf(bf16_bits_to_f(U.s[r][i]) * d, float(tot[r]), fmaf(bf16_bits_to_f(U.b[r][i]), xsc, acc[r]));
        continue;
      }
      float d[RPU] = {};
#pragma unroll
      for (int wi = 0; wi < 4; ++wi) {
        float xv[kPW];
#pragma unroll
        for (int h = 0; h < kPW / 4; ++h) {
          const float4 f = xs[xslot(e0 + wi * kPW + 4 * h)];
          xv[4 * h] = f.x, xv[4 * h + 1] = f.y, xv[4 * h + 2] = f.z, xv[4 * h + 3] = f.w;
        }
#pragma unroll
        for (int r = 0; r < RPU; ++r) {
          const uint4& q = U.q[r][i];
          float v[kPW];
          Q::decode(wi == 0 ? q.x : wi == 1 ? q.y : wi == 2 ? q.z : q.w, v);
#pragma unroll
          for (int j = 0; j < kPW; ++j) d[r] = fmaf(v[j], xv[j], d[r]);  // Σ (kOffset + q)·x
        }
      }
#pragma unroll
      for (int r = 0; r < RPU; ++r) {
        const float sc = bf16_bits_to_f(U.s[r][i]), b = bf16_bits_to_f(U.b[r][i]) - Q::kOffset * sc;
        acc[r] = fmaf(sc, d[r], fmaf(b, xsum[c], acc[r]));
      }
    }
#pragma unroll
    for (int r = 0; r < RPU; ++r) {
      float v = warp_sum(acc[r]);
      if constexpr (FOLD) v *= r_fold;
      if (lane == 0) {
        int n;
        const QmvSeg& sg = locate_row(p, RPU * unit + r, n);
        if (p.y_f32)
          static_cast<float*>(sg.y)[n] = v;
        else
          static_cast<bf16*>(sg.y)[n] = __float2bfloat16(v);
      }
    }
  };

  StreamUnit<RPU, CPL> A, B;
  pdl_trigger();
  if (u < units) load(u, A);  // the weight stream starts before the previous kernel is done
  pdl_wait();
  // FOLD with m: this thread's share of the normed row (the router's m, for the experts), loaded now, stored at the end
  const int mi = blockIdx.x * blockDim.x + threadIdx.x;
  const bool m_here = FOLD && p.m && mi < p.K && gridDim.x * blockDim.x >= p.K;
  float m_x = 0.0f, m_w = 0.0f;
  if (m_here) m_x = p.xf[mi], m_w = p.nw[mi];
  if constexpr (X16) {
    stage_x16<BITS>(p.x, p.chunks, xi, xsum, xd);
  } else {
    stage_x<BITS, 1>(p, xs, xsum);
  }
  if constexpr (FOLD) fold_scale(p, &r_fold);
  __syncthreads();
  if constexpr (FOLD) {
    if (p.m && gridDim.x * blockDim.x < p.K)  // more elements than threads: a grid-stride pass now
      for (int i = mi; i < p.K; i += gridDim.x * blockDim.x) p.m[i] = __float2bfloat16(p.xf[i] * r_fold * p.nw[i]);
  }
  while (u < units) {  // two units per trip, so that A and B swap roles without run-time register indexing
    const int u1 = u + warps;
    if (u1 < units) load(u1, B);
    compute(u, A);
    if (u1 >= units) break;
    const int u2 = u1 + warps;
    if (u2 < units) load(u2, A);
    compute(u1, B);
    u = u2;
  }
  if (m_here) p.m[mi] = __float2bfloat16(m_x * r_fold * m_w);
}

// ---- the tensor-core GEMV (switch qmv_mma): kQmvMaxT < T ≤ kQmvShortMaxT ------------------------------------------
// A short prompt tail (the server's 14-token assistant header) is too long for fp32 SIMT (T FMAs per code) and too
// short for the tile GEMMs (N/256 blocks at 64 tokens a tile). Here the T ≤ 16 tokens are the 16 rows of A (x, zero
// past T) of mma.sync m16n8k16 and 8 weight rows the columns of B, each code dequantised in registers to bf16
// (s·q + b rounded once: the tile GEMMs' numerics) straight from its load, so W is read once at the streaming rate.
// Block = 8 warps over kMmaTiles n-tiles of 8 rows; warp w takes the 64-k steps w, w + 8, … (a K split, summed in
// shared memory in a fixed order). In a step lane (g, c) = (lane / 4, lane % 4) loads codes k0 + 16c .. k0 + 16c + 15
// of row 8i + g of each n-tile i (8 bytes at 4 bits, 16 at 8) and x[g], x[g + 8] at the same k; mma j multiplies codes
// 16c + 4j .. 16c + 4j + 3: the k order inside an mma is a permutation both operands share, so it sums the same
// products. Tried and removed (benchmarks/NOTES.md, v10): a block's weight rows staged in shared memory by cp.async,
// and x rows staged in shared memory with 32-row blocks; both slower, here and for the ≤ 16-row experts.
constexpr int kMmaWarps = 8;
constexpr int kMmaTiles = 2;  // n-tiles of 8 rows per block: 16 rows, ≤ 102 registers (two blocks per SM); with 4
                              // tiles 160 (one block per SM)

template <int BITS, int RT>
struct MmaStep {
  uint32_t q[RT][BITS / 2];  // 16 codes of this lane's row in each n-tile: 2 words (4-bit) or 4 (8-bit)
  uint16_t s[RT], b[RT];     // their group's scale and bias
  uint4 x[2][2];             // x[g] and x[g + 8] at the same 16 k (zero past T)
};

template <int BITS>
__global__ void __launch_bounds__(kMmaWarps * 32, 2) qmv_mma_kernel(const QmvParams p, int T) {
  using Q = QCodes<BITS>;
  constexpr int RT = kMmaTiles, R = 8 * RT, kWords = BITS / 2, kPW = Q::kPerWord;
  __shared__ float red[kMmaWarps][16][R];  // each warp's partial sums [token][row]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int steps = p.K / 64, row0 = blockIdx.x * R, lg = p.gshift + (BITS == 4 ? 5 : 4);  // log2(group)

  const uint32_t* wrow[RT];  // this lane's row of each n-tile (rows past the launch's repeat the last one)
  const uint16_t *srow[RT], *brow[RT];
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    int n;
    const QmvSeg& sg = locate_row(p, min(row0 + 8 * i + g, p.rows - 1), n);
    wrow[i] = sg.w + size_t(n) * (p.K * BITS / 32);
    srow[i] = sg.s + size_t(n) * p.groups;
    brow[i] = sg.b + size_t(n) * p.groups;
  }

  auto load_w = [&](int st, MmaStep<BITS, RT>& S) {
    const int k = st * 64 + 16 * c;
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      if constexpr (BITS == 4) {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(wrow[i] + k / 8));
        S.q[i][0] = v.x, S.q[i][1] = v.y;
      } else {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(wrow[i] + k / 4));
        S.q[i][0] = v.x, S.q[i][1] = v.y, S.q[i][2] = v.z, S.q[i][3] = v.w;
      }
      S.s[i] = __ldg(srow[i] + (k >> lg));
      S.b[i] = __ldg(brow[i] + (k >> lg));
    }
  };
  auto load_x = [&](int st, MmaStep<BITS, RT>& S) {
    const int k = st * 64 + 16 * c;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = g + 8 * h;
      if (t < T) {
        const uint4* src = reinterpret_cast<const uint4*>(p.x + size_t(t) * p.K + k);
        S.x[h][0] = __ldg(src);
        S.x[h][1] = __ldg(src + 1);
      } else {
        S.x[h][0] = S.x[h][1] = make_uint4(0, 0, 0, 0);
      }
    }
  };

  float acc[RT][4];
#pragma unroll
  for (int i = 0; i < RT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  auto compute = [&](const MmaStep<BITS, RT>& S) {
    auto xpair = [&](int h, int m) {  // bf16 pair m (codes 2m, 2m + 1 of this lane's 16) of x[g + 8h]
      const uint4& v = S.x[h][m >> 2];
      const int w = m & 3;
      return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
    };
    uint32_t a[4][4];  // A fragment of mma j: rows g, g + 8 at k slots (2c, 2c + 1) and (2c + 8, 2c + 9)
#pragma unroll
    for (int j = 0; j < 4; ++j)
      a[j][0] = xpair(0, 2 * j), a[j][1] = xpair(1, 2 * j), a[j][2] = xpair(0, 2 * j + 1), a[j][3] = xpair(1, 2 * j + 1);
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      const float sc = bf16_bits_to_f(S.s[i]), b = bf16_bits_to_f(S.b[i]) - Q::kOffset * sc;
      uint32_t wp[8];  // bf16 pair m: codes 2m, 2m + 1
#pragma unroll
      for (int wi = 0; wi < kWords; ++wi) {
        float v[kPW];
        Q::decode(S.q[i][wi], v);
#pragma unroll
        for (int m = 0; m < kPW / 2; ++m)
          wp[wi * kPW / 2 + m] = pack_bf16(fmaf(sc, v[2 * m], b), fmaf(sc, v[2 * m + 1], b));  // W = s·q + b
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_bf16(acc[i], a[j], wp[2 * j], wp[2 * j + 1]);
    }
  };

  MmaStep<BITS, RT> A, B;
  int st = warp;
  pdl_trigger();
  if (st < steps) load_w(st, A);  // weights only before the wait
  pdl_wait();
  if (st < steps) load_x(st, A);
  while (st < steps) {  // two steps per trip, so that A and B swap roles without run-time register indexing
    const int s1 = st + kMmaWarps;
    if (s1 < steps) load_w(s1, B), load_x(s1, B);
    compute(A);
    if (s1 >= steps) break;
    const int s2 = s1 + kMmaWarps;
    if (s2 < steps) load_w(s2, A), load_x(s2, A);
    compute(B);
    st = s2;
  }

  // D of n-tile i: (token g, rows 8i + 2c, 2c + 1) and (token g + 8, the same rows).
#pragma unroll
  for (int i = 0; i < RT; ++i) {
    red[warp][g][8 * i + 2 * c] = acc[i][0];
    red[warp][g][8 * i + 2 * c + 1] = acc[i][1];
    red[warp][g + 8][8 * i + 2 * c] = acc[i][2];
    red[warp][g + 8][8 * i + 2 * c + 1] = acc[i][3];
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < T * R; idx += blockDim.x) {
    const int t = idx / R, r = idx - t * R, row = row0 + r;  // consecutive threads, consecutive rows
    if (row >= p.rows) continue;
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaWarps; ++w) v += red[w][t][r];
    int n;
    const QmvSeg& sg = locate_row(p, row, n);
    if (p.y_f32)
      static_cast<float*>(sg.y)[size_t(t) * sg.N + n] = v;
    else
      static_cast<bf16*>(sg.y)[size_t(t) * sg.N + n] = __float2bfloat16(v);
  }
}

// Shared memory of T rows of staged fp32 x and their chunk sums.
size_t stage_bytes(const QmvParams& p, int T) { return size_t(T) * p.K * 4 + size_t(T) * p.chunks * 4; }
// The same for one row staged as x16 (switch qmv_dp4a): 2 bytes an element, Σx and xd per chunk.
size_t stage_x16_bytes(const QmvParams& p) { return size_t(p.K) * 2 + size_t(p.chunks) * 8; }

template <int BITS, int T>
void launch_qmv(const Ctx& ctx, const QmvParams& p, int grid, size_t smem) {
  auto kernel = qmv_kernel<BITS, T>;
  if constexpr (T == 1)
    if (ctx.opts.on(Opt::qmv_dp4a)) {
      kernel = qmv_kernel<BITS, 1, true>;
      smem = stage_x16_bytes(p);
    }
  if (smem + red_bytes(T) > 48 * 1024) allow_smem(ctx, kernel, smem);  // dynamic + static past the default limit
  launch(ctx, kernel, grid, kWarps * 32, smem, p);
}

template <int BITS, int... Ts>
void launch_t(const Ctx& ctx, const QmvParams& p, int T, int grid, size_t smem, std::integer_sequence<int, Ts...>) {
  ((T == Ts + 1 ? launch_qmv<BITS, Ts + 1>(ctx, p, grid, smem) : void()), ...);
}

// The launch's parameters: the matrices side by side (checked by qmv_multi).
QmvParams qmv_params(const QMatrix* Ws, int n, const bf16* x, void* const* ys, bool y_f32) {
  const QMatrix& W = Ws[0];
  const int epc = 128 / W.bits;
  QmvParams p{};  // the fields a launch does not use stay null
  p.nseg = n;
  p.x = x;
  p.K = W.K;
  p.chunks = W.K / epc;
  p.groups = W.K / W.group;
  p.gshift = log2_exact(W.group / epc);
  p.y_f32 = y_f32;
  p.split_log = 0;
  p.rows = 0;
  for (int i = 0; i < n; ++i) {
    p.seg[i] = QmvSeg{Ws[i].w, Ws[i].scales, Ws[i].biases, ys[i], Ws[i].N, 0, p.rows};
    p.rows += Ws[i].N;
  }
  return p;
}

// kQmvMaxT < T ≤ kQmvShortMaxT on the tensor cores (switch qmv_mma; K a multiple of the 64-k step).
bool mma_applies(const Ctx& ctx, const QMatrix& W, int T) {
  return T > kQmvMaxT && T <= kQmvShortMaxT && W.K % 64 == 0 && ctx.opts.on(Opt::qmv_mma);
}

void qmv_mma(Ctx& ctx, const QMatrix* Ws, int n, const bf16* x, int T, void* const* ys, bool y_f32) {
  const QmvParams p = qmv_params(Ws, n, x, ys, y_f32);
  const unsigned grid = unsigned(cdiv(p.rows, 8 * kMmaTiles));
  dispatch_bits(Ws[0].bits, [&](auto bits) {
    launch(ctx, qmv_mma_kernel<decltype(bits)::value>, grid, kMmaWarps * 32, 0, p, T);
  });
  check_launch("qmv_mma");
}

// The streaming kernel takes one token with whole 32-chunk lanes (CPL 1 or 2, and 4 at 8 bits: 4-bit rows of 4096
// spill at CPL 4 and stay with qmv_kernel, which splits them over 4 warps) and every matrix in whole units of 4/CPL
// rows (all the real projections). Launches it and returns true, or returns false.
bool launch_stream(Ctx& ctx, const QMatrix* Ws, int n, const QmvParams& p, size_t smem) {
  const bool fold = p.xf != nullptr;
  const int bits = Ws[0].bits, cpl = p.chunks / 32, rpu = cpl >= 1 && cpl <= 4 ? 4 / cpl : 0;
  bool takes = p.chunks % 32 == 0 && rpu > 0 && (cpl == 1 || cpl == 2 || (cpl == 4 && bits == 8));
  for (int i = 0; i < n; ++i) takes = takes && Ws[i].N % rpu == 0;
  if (!takes) return false;
  const int blocks = int(std::min<int64_t>(int64_t(kStreamBlocksPerSm) * ctx.num_sms,
                                           cdiv(p.rows / rpu, kStreamWarps)));
  const bool x16 = ctx.opts.on(Opt::qmv_dp4a);
  if (x16) smem = stage_x16_bytes(p);
  dispatch_bits(bits, [&](auto bits_c) {
    constexpr int BITS = decltype(bits_c)::value;
    auto go = [&](auto cpl_c) {
      constexpr int CPL = decltype(cpl_c)::value;
      auto kernel = x16 ? (fold ? qmv_stream_kernel<BITS, CPL, true, true> : qmv_stream_kernel<BITS, CPL, true>)
                        : (fold ? qmv_stream_kernel<BITS, CPL, false, true> : qmv_stream_kernel<BITS, CPL, false>);
      if (smem > 48 * 1024) allow_smem(ctx, kernel, smem);
      launch(ctx, kernel, blocks, kStreamWarps * 32, smem, p);
    };
    if (cpl == 1)
      go(std::integral_constant<int, 1>{});
    else if (cpl == 2)
      go(std::integral_constant<int, 2>{});
    else if constexpr (BITS == 8)
      go(std::integral_constant<int, 4>{});
  });
  check_launch("qmv_stream");
  return true;
}


// qmv_kernel's grid: K split across warps while the grid is short of ~16 warps per SM and every lane keeps a whole
// chunk (p.split_log), each matrix's first block (p.seg[i].block0). Returns the blocks.
int plan_grid(const Ctx& ctx, const QMatrix* Ws, int n, QmvParams& p) {
  int64_t row_warps = 0;
  for (int i = 0; i < n; ++i) row_warps += cdiv(Ws[i].N, kRows);
  while (p.split_log < 3 && (64 << p.split_log) <= p.chunks && (row_warps << p.split_log) < 16 * ctx.num_sms)
    ++p.split_log;
  int64_t grid = 0;
  for (int i = 0; i < n; ++i) {
    p.seg[i].block0 = int(grid);
    grid += cdiv(Ws[i].N, (kWarps >> p.split_log) * kRows);
  }
  return int(grid);
}

size_t checked_stage_bytes(const Ctx& ctx, const QmvParams& p, int T) {
  const size_t smem = stage_bytes(p, T);
  LILY_CHECK(smem + red_bytes(T) <= ctx.smem_optin, "qmv: staging x for T=", T, ", K=", p.K, " needs ", smem,
             " bytes of shared memory, over the device's ", ctx.smem_optin);
  return smem;
}

// T ≤ kQmvMaxT: qmv_kernel, or qmv_stream_kernel for one token.
void qmv_simt(Ctx& ctx, const QMatrix* Ws, int n, const bf16* x, int T, void* const* ys, bool y_f32) {
  const QMatrix& W = Ws[0];
  QmvParams p = qmv_params(Ws, n, x, ys, y_f32);
  const size_t smem = checked_stage_bytes(ctx, p, T);
  if (T == 1 && ctx.opts.on(Opt::qmv_stream) && launch_stream(ctx, Ws, n, p, smem)) return;
  const int grid = plan_grid(ctx, Ws, n, p);
  dispatch_bits(W.bits, [&](auto bits) {
    launch_t<decltype(bits)::value>(ctx, p, T, grid, smem, std::make_integer_sequence<int, kQmvMaxT>{});
  });
  check_launch("qmv");
}

// backend/checks.h's rules, then this file's index width.
void check_args(const QMatrix* Ws, int n, const void* x, int T, int max_T, void* const* ys) {
  check_qmv(Ws, n, x, T, max_T, ys);
  for (int i = 0; i < n; ++i)
    LILY_CHECK(int64_t(Ws[i].N) * Ws[0].K * Ws[0].bits / 128 < (int64_t(1) << 31), "qmv: W (", Ws[i].N, "×",
               Ws[0].K, ") has too many 16-byte chunks for 32-bit indexing");
}

}  // namespace

bool qmv_takes(const Ctx& ctx, const QMatrix& W, int T) { return T <= kQmvMaxT || mma_applies(ctx, W, T); }

void qmv_multi(Ctx& ctx, const QMatrix* Ws, int n, const bf16* x, int T, void* const* ys, bool y_f32) {
  check_args(Ws, n, x, T, mma_applies(ctx, Ws[0], T) ? kQmvShortMaxT : kQmvMaxT, ys);
  if (T > kQmvMaxT)
    qmv_mma(ctx, Ws, n, x, T, ys, y_f32);
  else
    qmv_simt(ctx, Ws, n, x, T, ys, y_f32);
}

void qmv(Ctx& ctx, const QMatrix& W, const bf16* x, int T, void* y, bool y_f32) {
  qmv_multi(ctx, &W, 1, x, T, &y, y_f32);
}

bool qmv_fold(Ctx& ctx, const QMatrix* Ws, int n, const NormParts& x, float eps, void* const* ys, bool y_f32,
              bf16* m) {
  if (!ctx.opts.on(Opt::qmv_stream)) return false;
  check_args(Ws, n, x.xw, 1, kQmvMaxT, ys);
  LILY_CHECK(x.parts && x.n > 0 && x.n <= kNormMaxParts, "qmv_fold: ", x.n, " partial sums, 1 to ", kNormMaxParts);
  QmvParams p = qmv_params(Ws, n, x.xw, ys, y_f32);
  p.parts = x.parts, p.nparts = x.n, p.eps = eps, p.xf = x.x, p.nw = x.w, p.m = m;
  return launch_stream(ctx, Ws, n, p, checked_stage_bytes(ctx, p, 1));
}

NormParts qmv_residual(Ctx& ctx, const QMatrix& W, const bf16* y, float* x, const float* w, bf16* xw, float* ss) {
  void* const xv = x;
  check_args(&W, 1, y, 1, kQmvMaxT, &xv);
  QmvParams p = qmv_params(&W, 1, y, &xv, false);
  p.resid = x, p.w = w, p.xw = xw, p.ss = ss;
  const size_t smem = checked_stage_bytes(ctx, p, 1);
  const int grid = plan_grid(ctx, &W, 1, p);
  if (grid > kNormMaxParts) return {};
  dispatch_bits(W.bits, [&](auto bits) {
    constexpr int BITS = decltype(bits)::value;
    const bool x16 = ctx.opts.on(Opt::qmv_dp4a);
    auto kernel = x16 ? qmv_kernel<BITS, 1, true, true> : qmv_kernel<BITS, 1, false, true>;
    const size_t bytes = x16 ? stage_x16_bytes(p) : smem;
    if (bytes + red_bytes(1) > 48 * 1024) allow_smem(ctx, kernel, bytes);
    launch(ctx, kernel, grid, kWarps * 32, bytes, p);
  });
  check_launch("qmv_residual");
  return {x, ss, grid, w, xw};
}

}  // namespace lily::cuda
