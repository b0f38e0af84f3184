// qmm.cu: y = x · Wᵀ for any T (prefill), and the grouped expert GEMM of MoE prefill (architecture.md §3.2, §6,
// §9.3). T ≤ kQmvMaxT goes to qmv (qmv.cu); larger T to one tensor-core tile GEMM shared by both ops.
//
// Math     qmm:       y[t, n] = Σ_k x[t, k] · W[n, k],  W[n, k] = s[n, k/group]·q[n, k] + b[n, k/group]
//          moe_gemm:  y[r, n] = x[rows[r]] · A_e[n]  for offsets[e] ≤ r < offsets[e+1], or with B (SwiGLU fused)
//                     y[r, n] = silu(x[rows[r]] · A_e[n]) · (x[rows[r]] · B_e[n]).
//          W is dequantised one 128×64 tile at a time into shared memory as bf16 (never a full copy), products
//          in bf16 on tensor cores with fp32 accumulation. The bf16 rounding of W (2⁻⁹ relative per element) is the
//          only difference from the fp32 reference beyond summation order.
// Layout   W u32[E, N, K·bits/32] LSB first; s, b bf16[E, N, K/group]; x bf16[·, K]; qmm y [T, N] bf16 or fp32;
//          moe_gemm y bf16[max_rows, N]; offsets i32[E+1]; rows i32[max_rows] or null.
// Traffic  qmm T=4096, N=8192, K=2048 (q_proj, in_proj_qkv): x 16.8 MB + W 9.4 MB + y 67.1 MB = 93 MB (22 µs).
//          MoE at 4K tokens: 32768 routed rows; gate+up reads x rows 134 MB, experts 302 MB, writes 33.6 MB.
// Work     qmm 2·T·N·K = 137.4 GFLOP; MoE gate+up 2·32768·1024·2048 = 137.4 GFLOP, down 2·32768·2048·512 = 68.7.
//          Compute-bound. Floor at 790 TFLOP/s (measured bf16 peak, wgmma): 174 µs for 137.4 GFLOP; this mma.sync
//          kernel runs at ~270 TFLOP/s (500 µs).
// Mapping  block = 256 threads (8 warps, 2 along M × 4 along N), tile BM × 128 × 64 with BM = 128 (MI = 4) when
//          the grid has ≥ 2 waves of such tiles, else BM = 64 (MI = 2). Warp tile (BM/2) × 32: MI × 4
//          m16n8k16 mma per k16 step, A/B fragments by ldmatrix.x4 from XOR-swizzled 128-byte rows (conflict-free
//          for ldmatrix, cp.async and the dequant stores). Two stages: x tile k+1 by cp.async (zero-filled past
//          T or the expert's rows and past K) and the codes of W tile k+1 into registers while tile k multiplies;
//          the codes are then dequantised (byte-permute decode, one fma, bf16 pack) into the other stage. One
//          barrier per k step. Each thread copies MI x chunks (rows tid/8 + 32i, chunk tid%8) and dequantises 32
//          codes of weight row tid/2. Fused SwiGLU: the 128 tile rows interleave A and B in blocks of 8 (rows
//          16j..16j+7 of A_e, then the same of B_e), so a thread holds gate and up for the same (r, n) and the
//          epilogue writes silu(g)·u for 64 columns. moe_gemm: grid.y = ceil(max_rows/BM) + E ≥ the number of
//          non-empty row tiles; each block finds its (expert, tile) with a block-wide prefix sum of
//          ceil(count_e/BM) over the device offsets, and exits when past the last tile (no host sync).
// Checks   bits 4|8; group 32|64|128; K % group == 0; 16-byte aligned W and x; qmm W.E == 1; moe B like A;
//          offsets non-decreasing with offsets[E] − offsets[0] ≤ max_rows (not checkable on the host).
// Ref      cpu/qmm.cpp (qmm), cpu/moe.cpp (experts) · Test tests/ops (op qmm, T > 8; op moe)
// History  v1 (current): H200, T=4096, ncu: qmm N=8192 K=2048 499 µs (275 TFLOP/s), N=2048 K=4096 265 µs; about 270
//          TFLOP/s averaged over the model's dense projections; moe_gemm gate+up 869 µs / down 448 µs per layer
//          (158 / 153 TFLOP/s) with 64-row tiles, 706 / 387 µs with 128-row tiles from 96 rows per expert (switch
//          moe_tiles_128, 2026-12-01: +8 % on a 4K prompt). Tried and removed: dequantising tile k+1 a quarter at a
//          time between the k16 steps of tile k's MMAs (issue overlap): no gain (2026-12-01). On a 9.0 device both ops
//          run qmm_sm90.cu's wgmma kernel instead where it applies (switch wgmma); this one is the path without it.
#include "backend/cuda/gemm.cuh"
#include "backend/cuda/ops.cuh"

namespace lily::cuda {

namespace {

constexpr int kThreads = 256;       // 8 warps: 2 along M × 4 along N
constexpr int kBN = 128;            // weight rows per tile (A and B rows interleaved when fused)
constexpr int kBK = 64;             // k per stage
constexpr int kRowBytes = kBK * 2;  // one tile row in shared memory: 64 bf16 = 8 chunks of 16 bytes

template <int MI>
constexpr int kStageBytes = (32 * MI + kBN) * kRowBytes;  // x tile [BM][64] then W tile [128][64], bf16

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// Columns n, n+1 of one output row (n even); a pair store when both exist and the row is 4/8-byte aligned.
__device__ __forceinline__ void store2(float* row, int n, int N, float v0, float v1) {
  if (n + 1 < N && (N & 1) == 0) {
    *reinterpret_cast<float2*>(row + n) = make_float2(v0, v1);
  } else {
    if (n < N) row[n] = v0;
    if (n + 1 < N) row[n + 1] = v1;
  }
}
__device__ __forceinline__ void store2(bf16* row, int n, int N, float v0, float v1) {
  if (n + 1 < N && (N & 1) == 0) {
    *reinterpret_cast<__nv_bfloat162*>(row + n) = __floats2bfloat162_rn(v0, v1);
  } else {
    if (n < N) row[n] = __float2bfloat16(v0);
    if (n + 1 < N) row[n + 1] = __float2bfloat16(v1);
  }
}

// What one thread feeds into the tile: the x rows it copies and the weight row it dequantises.
template <int MI>
struct TileSrc {
  const bf16* xrow[MI];  // x row of tile row tid/8 + 32·i (null: outside the tile, zero-filled)
  const uint32_t* wrow;  // codes of tile weight row tid/2 (whole K)
  const uint16_t* srow;  // its scales [K/group]
  const uint16_t* brow;  // its biases [K/group]
};

// acc[i][j] += x-tile rows (wm·BM/2 + 16i ..) · W-tile rows (wn·32 + 8j ..) over all of K. group = 1 << gshift.
template <int BITS, int MI>
__device__ __forceinline__ void tile_gemm(const TileSrc<MI>& src, int K, int gshift, char* smem,
                                          float (&acc)[MI][4][4]) {
  using Q = QCodes<BITS>;
  constexpr int BM = 32 * MI;
  constexpr int kPW = Q::kPerWord;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int KT = (K + kBK - 1) / kBK;
  const int xr = tid >> 3, xc = tid & 7;  // x copy: rows xr + 32·i, chunk xc
  const int wv = tid >> 1, wh = tid & 1;  // W dequant: tile row wv, codes 32·wh .. 32·wh + 31 of the stage

  auto copy_x = [&](int kt, int stage) {
    const uint32_t dst = sbase + stage * kStageBytes<MI>;
    const int k = kt * kBK + xc * 8;
#pragma unroll
    for (int i = 0; i < MI; ++i) {
      const bool ok = src.xrow[i] != nullptr && k < K;
      const void* from = ok ? static_cast<const void*>(src.xrow[i] + k) : static_cast<const void*>(src.wrow);
      cp_async16(dst + swz(xr + 32 * i, xc), from, ok);
    }
    cp_async_commit();
  };

  uint4 wq[BITS / 4];  // 32 codes
  uint16_t ws = 0, wb = 0;
  bool wok = false;
  auto load_w = [&](int kt) {
    const int k0 = kt * kBK + wh * 32;
    wok = k0 < K;
    if (wok) {
      const uint4* p = reinterpret_cast<const uint4*>(src.wrow + k0 * BITS / 32);
#pragma unroll
      for (int v = 0; v < BITS / 4; ++v) wq[v] = __ldg(p + v);
      ws = __ldg(src.srow + (k0 >> gshift));
      wb = __ldg(src.brow + (k0 >> gshift));
    }
  };
  auto store_w = [&](int stage) {
    uint32_t pk[16];  // 32 bf16, element order
    if (wok) {
      const float s = bf16_bits_to_f(ws), b = bf16_bits_to_f(wb) - Q::kOffset * s;
#pragma unroll
      for (int j = 0; j < BITS; ++j) {
        const uint4& u = wq[j / 4];
        const uint32_t word = (j & 3) == 0 ? u.x : (j & 3) == 1 ? u.y : (j & 3) == 2 ? u.z : u.w;
        float v[kPW];
        Q::decode(word, v);
#pragma unroll
        for (int m = 0; m < kPW / 2; ++m)
          pk[j * kPW / 2 + m] = pack_bf16(fmaf(s, v[2 * m], b), fmaf(s, v[2 * m + 1], b));  // W = s·q + b
      }
    } else {
#pragma unroll
      for (int m = 0; m < 16; ++m) pk[m] = 0;
    }
    char* dst = smem + stage * kStageBytes<MI> + BM * kRowBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<uint4*>(dst + swz(wv, wh * 4 + i)) = make_uint4(pk[4 * i], pk[4 * i + 1], pk[4 * i + 2],
                                                                          pk[4 * i + 3]);
  };

  auto compute = [&](int stage) {
    const uint32_t xs = sbase + stage * kStageBytes<MI>, wsm = xs + BM * kRowBytes;
#pragma unroll
    for (int ks = 0; ks < kBK / 16; ++ks) {
      uint32_t a[MI][4], b[4][2];
#pragma unroll
      for (int i = 0; i < MI; ++i)  // 16×16 of x: lanes 0-15 rows 0-15 at k 0-7, lanes 16-31 at k 8-15
        ldmatrix_x4(a[i], xs + swz(wm * (BM / 2) + i * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {  // two n8 tiles: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (…)
        uint32_t r[4];
        ldmatrix_x4(r, wsm + swz(wn * 32 + jj * 16 + (lane & 7) + ((lane >> 4) << 3), ks * 2 + ((lane >> 3) & 1)));
        b[2 * jj][0] = r[0];
        b[2 * jj][1] = r[1];
        b[2 * jj + 1][0] = r[2];
        b[2 * jj + 1][1] = r[3];
      }
#pragma unroll
      for (int i = 0; i < MI; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_bf16(acc[i][j], a[i], b[j][0], b[j][1]);
    }
  };

  copy_x(0, 0);
  load_w(0);
  store_w(0);
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait_all();
    __syncthreads();  // stage kt complete; every warp is done reading stage kt+1 (from step kt-1)
    const bool more = kt + 1 < KT;
    if (more) {
      copy_x(kt + 1, (kt + 1) & 1);
      load_w(kt + 1);
    }
    compute(kt & 1);
    if (more) store_w((kt + 1) & 1);
  }
}

template <int MI>
__device__ __forceinline__ void zero_acc(float (&acc)[MI][4][4]) {
#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.0f;
}

template <int BITS, int MI>
__global__ void __launch_bounds__(kThreads, MI == 2 ? 3 : 2)
    qmm_kernel(const QMatrix W, const bf16* __restrict__ x, int T, void* __restrict__ y, bool y_f32, int gshift) {
  extern __shared__ __align__(128) char smem[];
  pdl_trigger();
  pdl_wait();
  constexpr int BM = 32 * MI;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
  const int N = W.N, K = W.K;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * kBN;

  TileSrc<MI> src;
#pragma unroll
  for (int i = 0; i < MI; ++i) {
    const int m = m0 + (tid >> 3) + 32 * i;
    src.xrow[i] = m < T ? x + size_t(m) * K : nullptr;
  }
  const size_t n = size_t(min(n0 + (tid >> 1), N - 1));  // rows past N repeat row N-1; never stored
  src.wrow = W.w + n * (size_t(K) * BITS / 32);
  src.srow = W.scales + n * size_t(K >> gshift);
  src.brow = W.biases + n * size_t(K >> gshift);

  float acc[MI][4][4];
  zero_acc(acc);
  tile_gemm<BITS, MI>(src, K, gshift, smem, acc);

#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = m0 + wm * (BM / 2) + i * 16 + (lane >> 2) + 8 * h;
      if (m >= T) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int nn = n0 + wn * 32 + j * 8 + 2 * (lane & 3);
        if (y_f32)
          store2(static_cast<float*>(y) + size_t(m) * N, nn, N, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        else
          store2(static_cast<bf16*>(y) + size_t(m) * N, nn, N, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
      }
    }
}

template <int BITS, int MI, bool FUSED>
__global__ void __launch_bounds__(kThreads, MI == 2 ? 3 : 2)
    moe_gemm_kernel(const QMatrix A, const QMatrix B, const int32_t* __restrict__ offsets,
                    const int32_t* __restrict__ rows, const bf16* __restrict__ x, bf16* __restrict__ y, int gshift) {
  extern __shared__ __align__(128) char smem[];
  constexpr int BM = 32 * MI;
  constexpr int kOutN = FUSED ? kBN / 2 : kBN;  // output columns per tile
  pdl_trigger();
  pdl_wait();
  int e, r0, r1;
  if (!find_tile<BM>(offsets, A.E, blockIdx.y, e, r0, r1)) return;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
  const int N = A.N, K = A.K;
  const int n0 = blockIdx.x * kOutN;

  TileSrc<MI> src;
#pragma unroll
  for (int i = 0; i < MI; ++i) {
    const int r = r0 + (tid >> 3) + 32 * i;
    src.xrow[i] = r < r1 ? x + size_t(rows ? rows[r] : r) * K : nullptr;
  }
  const int v = tid >> 1;  // tile row; fused: rows 16j..16j+7 are A rows n0+8j.., rows 16j+8.. the same of B
  const bool from_b = FUSED && ((v >> 3) & 1);
  const int n = min(FUSED ? n0 + (v >> 4) * 8 + (v & 7) : n0 + v, N - 1);
  const QMatrix& M = from_b ? B : A;
  const size_t wr = size_t(e) * N + n;
  src.wrow = M.w + wr * (size_t(K) * BITS / 32);
  src.srow = M.scales + wr * size_t(K >> gshift);
  src.brow = M.biases + wr * size_t(K >> gshift);

  float acc[MI][4][4];
  zero_acc(acc);
  tile_gemm<BITS, MI>(src, K, gshift, smem, acc);

#pragma unroll
  for (int i = 0; i < MI; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + wm * (BM / 2) + i * 16 + (lane >> 2) + 8 * h;
      if (r >= r1) continue;
      bf16* yr = y + size_t(r) * N;
      if constexpr (FUSED) {
#pragma unroll
        for (int p = 0; p < 2; ++p) {  // acc[i][2p] gate, acc[i][2p+1] up, same columns
          const int nn = n0 + wn * 16 + p * 8 + 2 * (lane & 3);
          const float* g = acc[i][2 * p];
          const float* u = acc[i][2 * p + 1];
          store2(yr, nn, N, siluf_(g[2 * h]) * u[2 * h], siluf_(g[2 * h + 1]) * u[2 * h + 1]);
        }
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j)
          store2(yr, n0 + wn * 32 + j * 8 + 2 * (lane & 3), N, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
      }
    }
}

template <int BITS, int MI>
void launch_qmm(const Ctx& ctx, const QMatrix& W, const bf16* x, int T, void* y, bool y_f32, int gshift) {
  constexpr int smem = 2 * kStageBytes<MI>;
  allow_smem(ctx, qmm_kernel<BITS, MI>, smem);
  const dim3 grid(unsigned(cdiv(W.N, kBN)), unsigned(cdiv(T, 32 * MI)));
  launch(ctx, qmm_kernel<BITS, MI>, grid, kThreads, smem, W, x, T, y, y_f32, gshift);
}

template <int BITS, int MI, bool FUSED>
void launch_moe(const Ctx& ctx, const QMatrix& A, const QMatrix& B, const int32_t* offsets, const int32_t* rows,
                int max_rows, const bf16* x, bf16* y, int gshift) {
  constexpr int smem = 2 * kStageBytes<MI>;
  allow_smem(ctx, moe_gemm_kernel<BITS, MI, FUSED>, smem);
  const int64_t tiles = cdiv(max_rows, 32 * MI) + A.E;  // ≥ Σ_e ceil(count_e / BM)
  LILY_CHECK(tiles <= 65535, "moe_gemm: max_rows=", max_rows, " with E=", A.E, " needs ", tiles,
             " row tiles, over the grid limit 65535");
  const dim3 grid(unsigned(cdiv(A.N, FUSED ? kBN / 2 : kBN)), unsigned(tiles));
  launch(ctx, moe_gemm_kernel<BITS, MI, FUSED>, grid, kThreads, smem, A, B, offsets, rows, x, y, gshift);
}

void check_out_alignment(const char* op, const void* y, int N, int elem_bytes) {
  LILY_CHECK(N % 2 != 0 || reinterpret_cast<uintptr_t>(y) % (2 * elem_bytes) == 0, op, ": y is not ",
             2 * elem_bytes, "-byte aligned");
}

}  // namespace

void qmm(Ctx& ctx, const QMatrix& W, const bf16* x, int T, void* y, bool y_f32) {
  if (qmv_takes(ctx, W, T)) {
    qmv(ctx, W, x, T, y, y_f32);
    return;
  }
  check_qmm(W, x, y);
  check_out_alignment("qmm", y, W.N, y_f32 ? 4 : 2);
  LILY_CHECK(cdiv(T, 64) <= 65535, "qmm: T=", T, " exceeds the grid limit");
  if (sm90_gemm_applies(ctx, W)) {
    qmm_sm90(ctx, W, x, T, y, y_f32);
    return;
  }
  const int gshift = log2_exact(W.group);
  // 128-row tiles when they give at least two waves, else 64-row tiles (twice the blocks).
  const bool big = cdiv(T, 128) * cdiv(W.N, kBN) >= 2 * ctx.num_sms;
  dispatch_bits(W.bits, [&](auto bits) {
    constexpr int BITS = decltype(bits)::value;
    if (big)
      launch_qmm<BITS, 4>(ctx, W, x, T, y, y_f32, gshift);
    else
      launch_qmm<BITS, 2>(ctx, W, x, T, y, y_f32, gshift);
  });
  check_launch("qmm");
}

void moe_gemm(Ctx& ctx, const QMatrix& A, const QMatrix* B, const int32_t* offsets, const int32_t* rows,
              int max_rows, int expert_rows, const bf16* x, bf16* y) {
  check_moe_gemm(A, B, offsets, x, y, max_rows);
  check_out_alignment("moe_gemm", y, A.N, 2);
  if (max_rows == 0) return;
  if (sm90_gemm_applies(ctx, A)) {
    moe_gemm_sm90(ctx, A, B, offsets, rows, max_rows, expert_rows, x, y);
    return;
  }
  const int gshift = log2_exact(A.group);
  // 128-row tiles when experts average ≥ 96 rows (switch moe_tiles_128; without it ≥ 256): each dequantised weight
  // tile then serves twice the rows, at the price of the partial last tile of each expert (typical prefill: 32768
  // rows / 256 experts = 128 per expert).
  const int64_t per_expert = ctx.opts.on(Opt::moe_tiles_128) ? 96 : 256;
  const bool big = int64_t(max_rows) >= per_expert * A.E;
  dispatch_bits(A.bits, [&](auto bits) {
    constexpr int BITS = decltype(bits)::value;
    if (B && big)
      launch_moe<BITS, 4, true>(ctx, A, *B, offsets, rows, max_rows, x, y, gshift);
    else if (B)
      launch_moe<BITS, 2, true>(ctx, A, *B, offsets, rows, max_rows, x, y, gshift);
    else if (big)
      launch_moe<BITS, 4, false>(ctx, A, A, offsets, rows, max_rows, x, y, gshift);
    else
      launch_moe<BITS, 2, false>(ctx, A, A, offsets, rows, max_rows, x, y, gshift);
  });
  check_launch("moe_gemm");
}

}  // namespace lily::cuda
