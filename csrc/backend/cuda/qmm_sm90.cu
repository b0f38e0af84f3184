// qmm_sm90.cu: the Hopper form (sm_90a wgmma) of the tensor-core GEMMs of qmm and moe_gemm (qmm.cu), switch `wgmma`.
//
// Math     as qmm.cu: y[t, n] = Σ_k x[t, k]·W[n, k], W = s·q + b (4-bit codes, group ≥ 64), and the grouped expert
//          GEMM over sorted rows with SwiGLU fused. Computed transposed, yᵀ = W·xᵀ: the weight rows are wgmma's M side
//          and come from registers, the tokens its N side and come from shared memory, so the dequantised weights
//          never touch shared memory. W is rounded once to bf16 (fma.bf16x2: s·q + b rounded once), products in bf16
//          with fp32 accumulation: the same rounding as qmm.cu's kernel.
// Work     qmm at T = 4096: 2·T·N·K, 137 GFLOP for N = 8192, K = 2048; MoE gate+up 137, down 69 GFLOP per layer.
//          Floor at ~790 TFLOP/s (measured bf16 peak): 174 µs for 137 GFLOP. qmm.cu's mma.sync kernel runs these at
//          ~270 (dense) and ~190 TFLOP/s (experts, whose last tile per expert is mostly empty).
// Traffic  every k-step a block copies NT token rows (NT·128 B) and its 256 weight rows' codes (8 KB) from L2 into
//          shared memory: 24 KB per 2·256·128·64 FLOP at NT = 128 (the first form, 128 rows × 256 tokens, moved
//          36 KB for the same products).
// Mapping  block = 2 warpgroups (256 threads); warpgroup g owns weight rows 128g .. 128g+127 of the block's 256 as
//          two wgmma M halves of 64; warp w of a half rows 16w .. 16w+15, in the A-fragment layout of m16n8k16: a
//          thread dequantises rows 16w + lane/4 and that + 8 at k = 2(lane%4) + {0, 1, 8, 9} of every k16 step into
//          the fragment (byte permute, lop3, sub and fma.bf16x2 per pair of codes). Tokens: NT per block (qmm 128 or
//          64; MoE 128, and 64/32/16 for an expert's partial last tile), copied by cp.async with the codes into a
//          ring of stages (tokens in the 128-byte swizzle wgmma reads through K-major descriptors); the scales and
//          biases of the block's rows for all of K are copied once. Per k-step: barrier (the stage landed
//          everywhere, every warpgroup done with step kt−2), refill the stage of kt−2, then for each half: dequantise
//          its fragments, issue its 4 wgmma m64nNTk16 as one group, wait for the group before it — so one group is
//          always in flight while the next half is dequantised. Epilogue through shared memory (padded rows) so
//          that y is written in 16-byte rows; fused SwiGLU: fragment rows 0–7 are gate rows and 8–15 the up rows of
//          the same 8 columns, so a thread holds both and writes silu(g)·u.
// Checks   (the caller, qmm.cu) 4-bit, group ≥ 64, K % 64 == 0, K/group ≤ 64, built for sm_90a, on a 9.0 device.
// Ref      cpu/qmm.cpp, cpu/moe.cpp · Test tests/ops (op qmm T > 8, op moe; switch on and off)
// History  H200, T = 4096, ncu per call, N = 8192 × K = 2048 / MoE gate+up / MoE down per layer (qmm.cu's mma.sync
//          kernel: 499 / 703 / 385 µs):
//          v1 128 weight rows × 256 tokens, codes loaded into registers one step ahead: 382 / 694 / 409 µs.
//          v2 the codes copied with the tokens into the stages, S − 2 steps ahead: 382 / 611 / 368 µs.
//          v3 256 weight rows × 128 tokens: 365 / 534 / 288 µs.
//          v4 (current, 2026-12-02) the scales and biases copied by cp.async with the first stage instead of loaded
//          by a loop before it: 345 / 488 / 269 µs. The dense GEMM runs at 400 TFLOP/s: a k-step takes ~1.35 µs
//          against 0.55 µs of tensor work and ~2.3 TB/s of L2 copies chip-wide; what stalls it is not yet measured
//          (ncu's stall reasons are next: the barrier per step with one block per SM is the first suspect).
//          v5 (2026-12-02) a prompt tail of ≤ 16 tokens (every expert ≤ 16 rows) on an instance with only the 16-row
//          tile, 95 registers and two blocks per SM (switch moe_tiles_16): the 14-token forward 10.57 → 9.90 ms
//          (ncu before: gate+up 76, down 46 µs per layer at 1.0–1.25 TB/s, one block per SM over ~90 experts).
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/ops.cuh"
#include "backend/cuda/wgmma.cuh"

namespace lily::cuda {

namespace {

constexpr int kThreads = 256;  // two warpgroups
constexpr int kRows = 256;     // weight rows per block
constexpr int kBK = 64;
constexpr int kStages = 6;     // copies run kStages − 2 steps ahead

// Where a block's 256 weight rows come from. Block row R = 64·(2·warpgroup + half) + 16·warp + r (r < 16) is the
// fragment row r of that warp: plain, weight row n0 + R; fused SwiGLU, gate row (r < 8) or up row (r ≥ 8) of column
// n0 + 8·(R / 16) + r mod 8. Rows past N repeat row N − 1 (never stored). base: the expert's first row in the stack.
struct BlockRows {
  const uint32_t* w[2];
  const uint16_t* s[2];
  const uint16_t* b[2];
  size_t base;
  int n0, N;
  bool fused;
  __device__ __forceinline__ size_t row(int R, int& m) const {
    const int r = R & 15;
    m = fused && r >= 8 ? 1 : 0;
    const int col = fused ? n0 + (R >> 4) * 8 + (r & 7) : n0 + R;
    return base + size_t(min(col, N - 1));
  }
};

__device__ __forceinline__ uint32_t word_of(const uint4& u, int j) {
  return j == 0 ? u.x : j == 1 ? u.y : j == 2 ? u.z : u.w;
}

// Byte offset of 16-byte half h of block row R's 64 codes in a stage: halves swapped every 4 rows, so that the 8 rows
// a warp reads at once fall in distinct banks.
__device__ __forceinline__ int code_off(int R, int h) { return R * 32 + (((h ^ (R >> 2)) & 1) << 4); }

// The A fragments of one k-step for rows R0 and R0 + 8 from the stage's codes: a[s] for k16 step s = {row g k 2c,
// 2c+1; row g+8 same; row g k 2c+8, 2c+9; row g+8 same}. Word j of a row holds k = 8j .. 8j+7; its byte c codes 2c
// (low nibble) and 2c+1 (high nibble).
__device__ __forceinline__ void dequant_step(const char* codes, const uint16_t* ss, const uint16_t* sb, int G, int gi,
                                             int R0, uint32_t sel, uint32_t (&a)[4][4]) {
  uint4 q[2][2];
  __nv_bfloat162 s2[2], b2[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int R = R0 + 8 * i;
    q[i][0] = *reinterpret_cast<const uint4*>(codes + code_off(R, 0));
    q[i][1] = *reinterpret_cast<const uint4*>(codes + code_off(R, 1));
    __nv_bfloat16_raw rs, rb;
    rs.x = ss[R * G + gi];
    rb.x = sb[R * G + gi];
    s2[i] = __bfloat162bfloat162(bf16(rs));
    b2[i] = __bfloat162bfloat162(bf16(rb));
  }
  const __nv_bfloat162 off = __floats2bfloat162_rn(128.0f, 128.0f);
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int h = 0; h < 2; ++h)      // k 2c.. (h = 0) or 2c+8.. (h = 1): word 2s + h
#pragma unroll
      for (int i = 0; i < 2; ++i) {  // row g or g + 8
        const uint32_t w = word_of(q[i][s >> 1], 2 * (s & 1) + h);
        const uint32_t t = (__byte_perm(w, w >> 4, sel) & 0x000F000Fu) | 0x43004300u;  // bf16 pair 128 + q
        __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&t);
        v = __hfma2(__hsub2(v, off), s2[i], b2[i]);  // s·q + b, rounded once
        a[s][2 * h + i] = *reinterpret_cast<const uint32_t*>(&v);
      }
}

constexpr int kMaxGroups = 64;  // K / group: the block's scales and biases are held in shared memory whole
__host__ __device__ constexpr int round1k(int v) { return (v + 1023) & ~1023; }
__host__ __device__ constexpr int scale_bytes(int G) { return round1k(2 * kRows * G * 2); }
template <int NT>
constexpr int kStageBytes = NT * 128 + kRows * 32;  // token rows (bf16, 64 k) then the block rows' codes

// acc[2][NT/2] (the two m64nNT accumulators of this warpgroup) = the block's weight rows · the NT token rows, over
// all of K. xrow[i]: the x row copied into tile row tid/8 + 32i (−1: none, zero-filled). smem (1024-aligned, sbase
// its shared address): the block's scales and biases, then the ring of stages.
template <int NT>
__device__ __forceinline__ void mainloop(const BlockRows& br, const int (&xrow)[NT >= 32 ? NT / 32 : 1],
                                         const bf16* x, int K, int gshift, char* smem, uint32_t sbase,
                                         float (&acc0)[NT / 2], float (&acc1)[NT / 2]) {
#ifdef LILY_SM90A_DEVICE
  constexpr int SB = kStageBytes<NT>, NX = NT >= 32 ? NT / 32 : 1;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int KT = K / kBK, G = K >> gshift;
  const uint32_t sel = uint32_t(lane & 3) | (uint32_t(4 + (lane & 3)) << 8);
  const int xr = tid >> 3, xc = tid & 7;
  const int R0 = (warp >> 2) * 128 + (warp & 3) * 16 + (lane >> 2);  // fragment rows R0 (+8) and R0 + 64 (+8)
  uint16_t* ss = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sb = ss + kRows * G;
  const int st0 = scale_bytes(G);

  // The codes this thread copies each step: half tid&1 of block rows tid/2 and tid/2 + 128.
  const uint4* crow[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    int m;
    const size_t n = br.row((tid >> 1) + 128 * i, m);
    crow[i] = reinterpret_cast<const uint4*>((m ? br.w[1] : br.w[0]) + n * (size_t(K) / 8)) + (tid & 1);
  }
  // The rows' scales and biases for all of K, once: copied with the first stage when a row's are whole 16-byte
  // chunks (G % 8 == 0, every real shape), else loaded; visible after the first step's barrier either way.
  if ((G & 7) == 0) {
    const int CH = G / 8;  // chunks per row
    for (int i = tid; i < kRows * CH; i += kThreads) {
      const int R = i / CH, j = i - R * CH;
      int m;
      const size_t n = br.row(R, m);
      const uint32_t dst = sbase + uint32_t(R * G * 2 + 16 * j);
      cp_async16(dst, (m ? br.s[1] : br.s[0]) + n * G + 8 * j, true);
      cp_async16(dst + kRows * G * 2, (m ? br.b[1] : br.b[0]) + n * G + 8 * j, true);
    }
  } else {
    for (int i = tid; i < kRows * G; i += kThreads) {
      const int R = i / G, gi = i - R * G;
      int m;
      const size_t n = br.row(R, m);
      ss[i] = __ldg((m ? br.s[1] : br.s[0]) + n * G + gi);
      sb[i] = __ldg((m ? br.b[1] : br.b[0]) + n * G + gi);
    }
  }
  const int coff = NT * 128 + code_off(tid >> 1, tid & 1);  // + 128·32 for the second row

  auto copy = [&](int kt) {
    if (kt < KT) {
      const uint32_t dst = sbase + st0 + (kt % kStages) * SB;
#pragma unroll
      for (int i = 0; i < NX; ++i) {
        const int row = xr + 32 * i;
        if (row < NT) {
          const bool ok = xrow[i] >= 0;
          const bf16* from = ok ? x + size_t(xrow[i]) * K + kt * kBK + xc * 8 : x;
          cp_async16(dst + swz(row, xc), from, ok);
        }
      }
      cp_async16(dst + coff, crow[0] + 2 * kt, true);
      cp_async16(dst + coff + 128 * 32, crow[1] + 2 * kt, true);
    }
    cp_async_commit();  // empty groups past the end keep the count uniform
  };

#pragma unroll
  for (int s = 0; s < kStages - 2; ++s) copy(s);
  uint32_t a0[4][4], a1[4][4];

  auto mma = [&](float(&acc)[NT / 2], const uint32_t(&a)[4][4], uint32_t stage, int kt) {
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; ++s) Wgmma<NT>::template rs<0>(acc, a[s], smem_desc(stage + s * 32), kt > 0 || s > 0);
    wgmma_commit();
  };
  int kt = 0;
  do {  // K ≥ 64: no path around the loop, so every accumulator comes out of it
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kStages - 3) : "memory");
    fence_proxy_async();
    __syncthreads();  // stage kt landed for every thread; every warpgroup is done with step kt − 2
    copy(kt + kStages - 2);  // into the stage of kt − 2
    const int so = st0 + (kt % kStages) * SB;
    const int gi = (kt * kBK) >> gshift;
    dequant_step(smem + so + NT * 128, ss, sb, G, gi, R0, sel, a0);  // while half 1 of step kt − 1 runs
    mma(acc0, a0, sbase + so, kt);
    wgmma_wait<1>();  // half 1 of step kt − 1 done: a1 is free
    dequant_step(smem + so + NT * 128, ss, sb, G, gi, R0 + 64, sel, a1);  // while half 0 runs
    mma(acc1, a1, sbase + so, kt);
    wgmma_wait<1>();  // half 0 done: a0 is free
  } while (++kt < KT);
  wgmma_wait<0>();
  fence_acc(acc0);
  fence_acc(acc1);
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  __syncthreads();  // every warpgroup done with the stages: the epilogue reuses them
#else
  __trap();
#endif
}

// The epilogue's staging tile: NT token rows of C output columns of type OT, each row padded by 16 bytes.
template <typename OT, int C>
constexpr int kPitch = C * int(sizeof(OT)) + 16;

// Stage the accumulators into smem as [token][column]; column = the fragment row (plain) or its gate/up pair's
// column (fused).
template <int NT, typename OT, bool FUSED>
__device__ __forceinline__ void stage_out(const float (&acc0)[NT / 2], const float (&acc1)[NT / 2], char* smem) {
  constexpr int C = FUSED ? kRows / 2 : kRows;
  constexpr int P = kPitch<OT, C>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    const float* acc = hf ? acc1 : acc0;
    const int R = (warp >> 2) * 128 + hf * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int j = 0; j < NT / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        char* row = smem + (8 * j + 2 * c + e) * P;
        if constexpr (FUSED) {
          const int col = (R >> 4) * 8 + g;
          *reinterpret_cast<OT*>(row + col * int(sizeof(OT))) = OT(siluf_(acc[4 * j + e]) * acc[4 * j + 2 + e]);
        } else {
          *reinterpret_cast<OT*>(row + R * int(sizeof(OT))) = OT(acc[4 * j + e]);
          *reinterpret_cast<OT*>(row + (R + 8) * int(sizeof(OT))) = OT(acc[4 * j + 2 + e]);
        }
      }
  }
}

// Write the staged tile: tile row t (< rows) goes to out row row_of(t), columns n0 .. n0 + C − 1 (< N).
template <int NT, typename OT, int C, typename RowOf>
__device__ __forceinline__ void write_out(const char* smem, int rows, RowOf row_of, OT* y, int N, int n0, bool vec) {
  constexpr int P = kPitch<OT, C>, E = 16 / int(sizeof(OT)), CH = C / E;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < NT * CH; i += kThreads) {
    const int t = i / CH, ch = i % CH;
    if (t >= rows) continue;
    const int n = n0 + ch * E;
    OT* dst = y + size_t(row_of(t)) * N + n;
    const char* src = smem + t * P + ch * 16;
    if (vec && n + E <= N) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < E && n + e < N; ++e) dst[e] = reinterpret_cast<const OT*>(src)[e];
    }
  }
}

// Dynamic shared memory: alignment slack, the scales and biases, and the stages (which the epilogue reuses).
template <int NT>
constexpr int kRingBytes = kStages * kStageBytes<NT> > NT * kPitch<float, kRows> ? kStages * kStageBytes<NT>
                                                                               : NT * kPitch<float, kRows>;
template <int NT>
constexpr int smem_bytes(int G) {
  return 1024 + scale_bytes(G) + kRingBytes<NT>;
}


template <int NT, typename OT>
__global__ void __launch_bounds__(kThreads, 1)
    qmm_sm90_kernel(const QMatrix W, const bf16* __restrict__ x, int T, OT* __restrict__ y, int gshift, bool vec) {
  extern __shared__ char smem_raw[];
  pdl_trigger();
  pdl_wait();
  uint32_t sbase;
  char* smem = aligned_1k(smem_raw, sbase);
  const int tid = threadIdx.x;
  const int N = W.N, K = W.K;
  const int m0 = blockIdx.y * NT, n0 = blockIdx.x * kRows;

  int xrow[NT >= 32 ? NT / 32 : 1];
#pragma unroll
  for (int i = 0; i < (NT >= 32 ? NT / 32 : 1); ++i) {
    const int m = m0 + (tid >> 3) + 32 * i;
    xrow[i] = m < T ? m : -1;
  }
  const BlockRows br{{W.w, W.w}, {W.scales, W.scales}, {W.biases, W.biases}, 0, n0, N, false};
  float acc0[NT / 2], acc1[NT / 2];
  mainloop<NT>(br, xrow, x, K, gshift, smem, sbase, acc0, acc1);
  char* out = smem + scale_bytes(K >> gshift);
  stage_out<NT, OT, false>(acc0, acc1, out);
  __syncthreads();
  write_out<NT, OT, kRows>(out, min(NT, T - m0), [&](int t) { return m0 + t; }, y, N, n0, vec);
}

// One (expert, row tile) of the grouped GEMM with NT ≥ the tile's rows.
template <int NT, bool FUSED>
__device__ __forceinline__ void moe_tile(const QMatrix& A, const QMatrix& B, int e, int r0, int r1,
                                         const int32_t* __restrict__ rows, const bf16* __restrict__ x,
                                         bf16* __restrict__ y, int gshift, bool vec, char* smem, uint32_t sbase) {
  const int tid = threadIdx.x;
  const int N = A.N, K = A.K;
  constexpr int C = FUSED ? kRows / 2 : kRows;  // output columns per block
  const int n0 = blockIdx.x * C;
  int xrow[NT >= 32 ? NT / 32 : 1];
#pragma unroll
  for (int i = 0; i < (NT >= 32 ? NT / 32 : 1); ++i) {
    const int r = r0 + (tid >> 3) + 32 * i;
    xrow[i] = r < r1 && (tid >> 3) + 32 * i < NT ? (rows ? rows[r] : r) : -1;
  }
  const BlockRows br{{A.w, B.w}, {A.scales, B.scales}, {A.biases, B.biases}, size_t(e) * N, n0, N, FUSED};
  float acc0[NT / 2], acc1[NT / 2];
  mainloop<NT>(br, xrow, x, K, gshift, smem, sbase, acc0, acc1);
  char* out = smem + scale_bytes(K >> gshift);
  stage_out<NT, bf16, FUSED>(acc0, acc1, out);
  __syncthreads();
  write_out<NT, bf16, C>(out, min(NT, r1 - r0), [&](int t) { return r0 + t; }, y, N, n0, vec);
}

// MAXNT: the most rows any expert holds (host bound). 16 (a prompt tail of ≤ 16 tokens, switch moe_tiles_16): only the
// 16-row tile is compiled in, whose registers and shared memory leave room for two blocks per SM.
template <bool FUSED, int MAXNT>
__global__ void __launch_bounds__(kThreads, MAXNT <= 16 ? 2 : 1)
    moe_sm90_kernel(const QMatrix A, const QMatrix B, const int32_t* __restrict__ offsets,
                    const int32_t* __restrict__ rows, const bf16* __restrict__ x, bf16* __restrict__ y, int gshift,
                    bool vec) {
  extern __shared__ char smem_raw[];
  pdl_trigger();
  pdl_wait();
  int e, r0, r1;
  if (!find_tile<128>(offsets, A.E, blockIdx.y, e, r0, r1)) return;
  uint32_t sbase;
  char* smem = aligned_1k(smem_raw, sbase);
  const int n = min(128, r1 - r0);  // rows of this tile: an expert's last tile is usually partial
  if constexpr (MAXNT > 16) {
    if (n > 64)
      moe_tile<128, FUSED>(A, B, e, r0, r1, rows, x, y, gshift, vec, smem, sbase);
    else if (n > 32)
      moe_tile<64, FUSED>(A, B, e, r0, r1, rows, x, y, gshift, vec, smem, sbase);
    else if (n > 16)
      moe_tile<32, FUSED>(A, B, e, r0, r1, rows, x, y, gshift, vec, smem, sbase);
    else
      moe_tile<16, FUSED>(A, B, e, r0, r1, rows, x, y, gshift, vec, smem, sbase);
  } else {
    moe_tile<16, FUSED>(A, B, e, r0, r1, rows, x, y, gshift, vec, smem, sbase);
  }
}

bool vec_ok(const void* y, int N, int elem) {
  return (size_t(N) * elem) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0;
}

}  // namespace

bool sm90_gemm_applies(const Ctx& ctx, const QMatrix& W) {
#ifdef LILY_CUDA_SM90A
  return ctx.sm90a && ctx.opts.on(Opt::wgmma) && W.bits == 4 && W.group >= kBK && W.K % kBK == 0 &&
         W.K / W.group <= kMaxGroups && W.N >= kRows;  // narrower: most of the block idle
#else
  (void)ctx, (void)W;
  return false;
#endif
}

void qmm_sm90(Ctx& ctx, const QMatrix& W, const bf16* x, int T, void* y, bool y_f32) {
  const int gshift = log2_exact(W.group);
  // 128-token tiles when they fill the GPU at least once (one block per SM), else 64.
  const bool big = cdiv(T, 128) * cdiv(W.N, kRows) >= ctx.num_sms;
  auto go = [&](auto nt, auto* out) {
    constexpr int NT = decltype(nt)::value;
    using OT = std::remove_pointer_t<decltype(out)>;
    const int smem = smem_bytes<NT>(W.K / W.group);
    allow_smem(ctx, qmm_sm90_kernel<NT, OT>, smem);
    const dim3 grid(unsigned(cdiv(W.N, kRows)), unsigned(cdiv(T, NT)));
    launch(ctx, qmm_sm90_kernel<NT, OT>, grid, kThreads, smem, W, x, T, out, gshift,
           vec_ok(y, W.N, int(sizeof(OT))));
  };
  using T128 = std::integral_constant<int, 128>;
  using T64 = std::integral_constant<int, 64>;
  if (y_f32) {
    if (big) go(T128{}, static_cast<float*>(y));
    else go(T64{}, static_cast<float*>(y));
  } else {
    if (big) go(T128{}, static_cast<bf16*>(y));
    else go(T64{}, static_cast<bf16*>(y));
  }
  check_launch("qmm (sm90)");
}

void moe_gemm_sm90(Ctx& ctx, const QMatrix& A, const QMatrix* B, const int32_t* offsets, const int32_t* rows,
                   int max_rows, int expert_rows, const bf16* x, bf16* y) {
  const int gshift = log2_exact(A.group);
  const int64_t tiles = cdiv(max_rows, 128) + A.E;  // ≥ Σ_e ceil(count_e / 128)
  LILY_CHECK(tiles <= 65535, "moe_gemm: max_rows=", max_rows, " with E=", A.E, " needs ", tiles,
             " row tiles, over the grid limit 65535");
  const bool v = vec_ok(y, A.N, 2);
  auto go = [&](auto maxnt) {
    constexpr int MAXNT = decltype(maxnt)::value;
    const int smem = smem_bytes<MAXNT>(A.K / A.group);  // the largest tile's; the smaller ones need less
    if (B) {
      allow_smem(ctx, moe_sm90_kernel<true, MAXNT>, smem);
      const dim3 grid(unsigned(cdiv(A.N, kRows / 2)), unsigned(tiles));
      launch(ctx, moe_sm90_kernel<true, MAXNT>, grid, kThreads, smem, A, *B, offsets, rows, x, y, gshift, v);
    } else {
      allow_smem(ctx, moe_sm90_kernel<false, MAXNT>, smem);
      const dim3 grid(unsigned(cdiv(A.N, kRows)), unsigned(tiles));
      launch(ctx, moe_sm90_kernel<false, MAXNT>, grid, kThreads, smem, A, A, offsets, rows, x, y, gshift, v);
    }
  };
  if (expert_rows <= 16 && ctx.opts.on(Opt::moe_tiles_16))
    go(std::integral_constant<int, 16>{});
  else
    go(std::integral_constant<int, 128>{});
  check_launch("moe_gemm (sm90)");
}

}  // namespace lily::cuda
