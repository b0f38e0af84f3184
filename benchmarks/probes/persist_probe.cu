// persist_probe.cu: what a persistent decode kernel would buy over Lily's graph of PDL kernels, before building one
// (issue 11's third direction). The question: is the step's ~1.5 µs per kernel boundary (v14's trace) a launch cost
// that a kernel which never ends removes, or the latency of a dependency, which it only moves?
//
// The work: a chain of 4-bit GEMVs y_s = W_s · x_s with the sizes of a GDN layer's weight reads, 40 layers deep
// (in_proj 12,352 rows · out_proj 2,048 × 4,096 as 4,096 rows · router 512 · gate+up of 9 experts 9,216 · down of 9
// experts as 4,096 rows, all K = 2,048: 34.9 MB a layer, 1.40 GB a step, so no layer stays in the 50 MB L2), and a
// chain of 200 tiny GEMVs (256 rows, 0.3 MB each) whose time is all boundary. x_s is y_{s−1} read cyclically
// (x[k] = y[k mod N_{s−1}]). Each unit of work is qmv_stream_kernel<4, 2>'s (qmv.cu): a warp reads 16-byte chunks
// lane and lane + 32 of 2 rows, decodes the codes with Lily's QCodes<4> (gemm.cuh), dots them with the swizzled fp32
// x staged in shared memory, and keeps the next unit in flight while it computes this one; 2 blocks of 8 warps per
// SM, 128 registers. (The MoE's routing, the GDN recurrence and the norms are not modelled: only weight reads and
// the dependencies between them.)
//
// Variants (each a CUDA graph of one step, replayed):
//   graph      one kernel per GEMV, ordinary launches (grid: the resident blocks, or one warp per unit if fewer);
//   pdl        one kernel per GEMV with programmatic dependent launch, the first unit loaded before the wait (Lily);
//   pdl2       the same with two units loaded before the wait;
//   persist    one kernel for the whole chain, grid = the SMs' resident blocks; after its units of GEMV s a block
//              loads its first unit of GEMV s + 1, then adds itself to s's counter (release) and waits until every
//              block has (acquire), then stages x; the counters are zeroed by a memset node before it;
//   persist2   the same with two units of GEMV s + 1 loaded before the wait;
//   flags      persist2 with a flag per block and GEMV instead of one counter (no atomics on one address);
//   floor      persist2 without the counters: wrong outputs (not checked), the time of the loads and arithmetic alone;
//   tc         `pdl`'s launches with another unit of work: the tensor-core GEMV with K split over warps (below).
// Every checked variant but `tc` runs the same arithmetic in the same order, so their outputs must agree bit for bit;
// each is also checked against a plain fp32 reference kernel per GEMV (each row's dequantised dot, fed the variant's
// own input, so errors do not compound), outputs poisoned with NaN first.
//
// Build and run (H200): nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o /tmp/persist benchmarks/probes/persist_probe.cu
//                       /tmp/persist
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cuda/gemm.cuh"
#include "probe.cuh"

namespace {

using lily::cuda::QCodes;
using lily::cuda::warp_sum;

constexpr int kWarps = 8, kThreads = 32 * kWarps, kBlocksPerSm = 2;
constexpr int kK = 2048, kCpl = 2, kRpu = 2;  // every GEMV's K; chunks of a row per lane; rows per unit

struct Gemv {
  const uint4* w;      // [N, K/32] 16-byte chunks of 32 codes
  const uint16_t* s;   // [N, K/64] bf16 bits
  const uint16_t* b;   // [N, K/64]
  const uint16_t* x;   // the previous output, bf16 bits: x[k] = x[k mod xn]
  int xn;
  uint16_t* y;         // [N] bf16 bits
  int N, K;
};

// One warp's unit: 4 chunks per lane, chunks lane and lane + 32 of 2 rows (qmv_stream_kernel<4, 2>).
struct Unit {
  uint4 q[4];
  uint16_t s[4], b[4];
};

__device__ __forceinline__ int xslot(int e) {  // qmv.cu's swizzle: rows of 32 floats, slot (e/4 mod 8) XOR row
  const int row = e >> 5;
  return row * 8 + (((e >> 2) ^ row) & 7);
}

__device__ __forceinline__ float bits_to_f(uint16_t v) { return __uint_as_float(uint32_t(v) << 16); }

__device__ __forceinline__ void load_unit(const Gemv& g, int u, int lane, Unit& U) {
  constexpr int C = kK / 32, G = kK / 64;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = j / kCpl, i = j % kCpl, n = u * kRpu + r, c = lane + 32 * i;
    U.q[j] = __ldg(g.w + size_t(n) * C + c);
    U.s[j] = __ldg(g.s + size_t(n) * G + c / 2);
    U.b[j] = __ldg(g.b + size_t(n) * G + c / 2);
  }
}

// x staged as swizzled fp32 and Σx per chunk. Read through L2 (ld.cg): in the persistent kernel another block wrote
// it during this launch, so a line left in this SM's L1 by an earlier GEMV must not be used.
__device__ void stage_x(const Gemv& g, float4* xs, float* xsum) {
  for (int c = threadIdx.x; c < kK / 32; c += blockDim.x) {
    const uint4* src = reinterpret_cast<const uint4*>(g.x + (c * 32) % g.xn);
    float sum = 0.0f;
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const uint4 raw = __ldcg(src + v);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      float f[8];
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        f[2 * h] = __uint_as_float(w[h] << 16);
        f[2 * h + 1] = __uint_as_float(w[h] & 0xFFFF0000u);
      }
      sum += ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
      const int e = c * 32 + 8 * v;
      xs[xslot(e)] = make_float4(f[0], f[1], f[2], f[3]);
      xs[xslot(e + 4)] = make_float4(f[4], f[5], f[6], f[7]);
    }
    xsum[c] = sum;
  }
}

__device__ __forceinline__ void compute_unit(const Gemv& g, int u, int lane, const Unit& U, const float4* xs,
                                             const float* xsum) {
  using Q = QCodes<4>;
  float acc[kRpu] = {};
#pragma unroll
  for (int i = 0; i < kCpl; ++i) {  // qmv_stream_kernel's order: chunk by chunk, the unit's rows sharing x's reads
    const int c = lane + 32 * i, e0 = c * 32;
    float d[kRpu] = {};
#pragma unroll
    for (int wi = 0; wi < 4; ++wi) {
      const float4 f0 = xs[xslot(e0 + 8 * wi)], f1 = xs[xslot(e0 + 8 * wi + 4)];
      const float xv[8] = {f0.x, f0.y, f0.z, f0.w, f1.x, f1.y, f1.z, f1.w};
#pragma unroll
      for (int r = 0; r < kRpu; ++r) {
        const uint4& q = U.q[r * kCpl + i];
        float v[8];
        Q::decode(wi == 0 ? q.x : wi == 1 ? q.y : wi == 2 ? q.z : q.w, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) d[r] = fmaf(v[k], xv[k], d[r]);  // Σ (128 + q)·x
      }
    }
#pragma unroll
    for (int r = 0; r < kRpu; ++r) {
      const float sc = bits_to_f(U.s[r * kCpl + i]), b = bits_to_f(U.b[r * kCpl + i]) - Q::kOffset * sc;
      acc[r] = fmaf(sc, d[r], fmaf(b, xsum[c], acc[r]));
    }
  }
#pragma unroll
  for (int r = 0; r < kRpu; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0) g.y[u * kRpu + r] = __bfloat16_as_ushort(__float2bfloat16(v));
  }
}

__device__ __forceinline__ int units_of(const Gemv& g) { return g.N / kRpu; }

// The warp's units u, u + warps, … of g; A holds u already, B holds u + warps when b_loaded (qmv_stream's loop).
__device__ __forceinline__ void run_units(const Gemv& g, int u, int warps, int lane, Unit& A, Unit& B, bool b_loaded,
                                          const float4* xs, const float* xsum) {
  const int units = units_of(g);
  while (u < units) {
    const int u1 = u + warps;
    if (u1 < units && !b_loaded) load_unit(g, u1, lane, B);
    b_loaded = false;
    compute_unit(g, u, lane, A, xs, xsum);
    if (u1 >= units) break;
    const int u2 = u1 + warps;
    if (u2 < units) load_unit(g, u2, lane, A);
    compute_unit(g, u1, lane, B, xs, xsum);
    u = u2;
  }
}
// Loads the warp's first PRE units of g (before a wait: weights only).
template <int PRE>
__device__ __forceinline__ void preload(const Gemv& g, int u, int warps, int lane, Unit& A, Unit& B) {
  if (u < units_of(g)) load_unit(g, u, lane, A);
  if (PRE == 2 && u + warps < units_of(g)) load_unit(g, u + warps, lane, B);
}
template <int PRE>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) gemv_kernel(const Gemv param) {
  const Gemv g = param;  // in registers, as the persistent kernel's
  __shared__ float4 xs[kK / 4];
  __shared__ float xsum[kK / 32];
  const int lane = threadIdx.x & 31, warps = gridDim.x * kWarps, u = blockIdx.x * kWarps + (threadIdx.x >> 5);
  Unit A, B;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  preload<PRE>(g, u, warps, lane, A, B);
  asm volatile("griddepcontrol.wait;" ::: "memory");  // a no-op without the PDL attribute
  stage_x(g, xs, xsum);
  __syncthreads();
  run_units(g, u, warps, lane, A, B, PRE == 2, xs, xsum);
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// WAIT 0 (variant `floor`): no counters at all, so a block reads x whatever its state: wrong outputs, but the time
// of the chain's loads and arithmetic alone, the floor any ordering between the GEMVs can reach. WAIT 1: one counter
// per GEMV that every block adds itself to (264 atomics on one address). WAIT 2 (variant `flags`): a flag per block
// and GEMV (done[s·grid + b], released by a plain store), which warp 0 of a waiting block polls 32 at a time.
template <int PRE, int WAIT = 1>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) persist_kernel(const Gemv* chain, int n, unsigned* done) {
  __shared__ float4 xs[kK / 4];
  __shared__ float xsum[kK / 32];
  const int lane = threadIdx.x & 31, warps = gridDim.x * kWarps, u = blockIdx.x * kWarps + (threadIdx.x >> 5);
  Unit A, B;
  preload<PRE>(chain[0], u, warps, lane, A, B);
  for (int s = 0; s < n; ++s) {
    const Gemv g = chain[s];
    if (WAIT == 1 && s > 0) {  // every block has written GEMV s − 1's rows
      if (threadIdx.x == 0)
        while (ld_acquire(done + s - 1) < gridDim.x) {
        }
      __syncthreads();
    }
    if (WAIT == 2 && s > 0) {
      if (threadIdx.x < 32) {
        const unsigned* f = done + size_t(s - 1) * gridDim.x;
        for (int b = threadIdx.x; b < int(gridDim.x); b += 32)
          while (ld_acquire(f + b) == 0) {
          }
        __syncwarp();
      }
      __syncthreads();
    }
    stage_x(g, xs, xsum);
    __syncthreads();
    run_units(g, u, warps, lane, A, B, PRE == 2, xs, xsum);
    if (s + 1 < n) preload<PRE>(chain[s + 1], u, warps, lane, A, B);  // weights: no dependency
    __syncthreads();  // the block's rows written, and its x reads done
    if (WAIT == 1 && threadIdx.x == 0) {
      __threadfence();
      atomicAdd(done + s, 1u);
    }
    if (WAIT == 2 && threadIdx.x == 0) {
      __threadfence();
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(done + size_t(s) * gridDim.x + blockIdx.x), "r"(1u)
                   : "memory");
    }
  }
}

// Variant `tc`: v12's open question asked on the same chain. Are the GEMVs issue-bound after their wait, so that the
// tensor cores' fewer instructions per code pay once the K is split over warps (v12's `qmv_tc` gave each warp a whole
// row tile, eight dependent steps, and lost: 6.9 → 10.5 µs)? One kernel per GEMV with PDL, as `pdl`. A block takes a
// tile of 16 rows at a time (tile b, b + grid, …); warp w takes codes 256w .. 256w + 255 of it (the window: groups
// 4w .. 4w + 3), so a warp's work per tile is 16 mmas. mma.sync m16n8k16: A = the 16 rows' codes as bf16 128 + q (one
// lop3 per pair: exact), B column n = x where the code lies in the window's group n and zero elsewhere, so that
// D[row][n] is the row's dot with group n alone and its scale applies after the products. Lane (g, c) loads rows g and
// g + 8, chunks 8w + c and 8w + 4 + c (16 bytes each: the four c lanes read 64 contiguous bytes of a row); chunk
// 8w + 4h + c lies in the window's group 2h + c/2, so lane (g, c) holds B's column g for the mmas of half h when
// g = 2h + c/2 (x of its chunk, the pairs ordered as the codes'), zeros otherwise. The k order inside an mma is a
// permutation both operands share. Per lane and tile: 4 loads of 16 bytes, 16 × 7 instructions turning codes into
// pairs, 16 mmas, ~20 for the scales (v5's SIMT count: ~72 per 16-byte chunk, i.e. 1.6× the issue). Lanes (g, c < 2)
// hold D's columns 2c, 2c + 1, the window's groups 2c and 2c + 1 of rows g and g + 8; the warps' partial sums meet in
// shared memory, added in warp order. Not bitwise comparable with the SIMT variants (another order of additions):
// checked against the reference only.
struct TcTile {
  uint4 q[4];         // rows g (chunks 8w + c, 8w + 4 + c), then row g + 8
  uint32_t s[2], b[2];  // rows g, g + 8: the bf16 scales and biases of groups 4w + 2(c & 1) and the next
};

__device__ __forceinline__ void tc_load(const Gemv& g, int tile, int w, int r, int c, TcTile& T) {
  constexpr int C = kK / 32, G = kK / 64;
  const size_t row = size_t(tile) * 16 + r;
  const uint4* q0 = g.w + row * C + 8 * w + c;
  const uint4* q1 = q0 + 8 * C;
  T.q[0] = __ldg(q0), T.q[1] = __ldg(q0 + 4), T.q[2] = __ldg(q1), T.q[3] = __ldg(q1 + 4);
  const size_t gi = row * G + 4 * w + 2 * (c & 1);
  T.s[0] = __ldg(reinterpret_cast<const uint32_t*>(g.s + gi));
  T.b[0] = __ldg(reinterpret_cast<const uint32_t*>(g.b + gi));
  T.s[1] = __ldg(reinterpret_cast<const uint32_t*>(g.s + gi + 8 * G));
  T.b[1] = __ldg(reinterpret_cast<const uint32_t*>(g.b + gi + 8 * G));
}

// Codes p and p + 4 of word q as a bf16 pair 128 + q (the exponent of 128, the code in the low mantissa bits).
__device__ __forceinline__ uint32_t tc_pair(uint32_t q, int p) { return ((q >> (4 * p)) & 0x000F000Fu) | 0x43004300u; }

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void tc_tile(const Gemv& g, int tile, int w, int r, int c, const TcTile& T,
                                        const uint32_t (&xb)[2][16], const float (&xs)[2], float (*part)[16]) {
  float d[2][4] = {};  // even and odd mmas: two chains of 8
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t qa = word_of(T.q[h], i), qb = word_of(T.q[2 + h], i);  // rows r and r + 8
      const uint32_t a0[4] = {tc_pair(qa, 0), tc_pair(qb, 0), tc_pair(qa, 1), tc_pair(qb, 1)};
      const uint32_t a1[4] = {tc_pair(qa, 2), tc_pair(qb, 2), tc_pair(qa, 3), tc_pair(qb, 3)};
      lily::cuda::mma_bf16(d[0], a0, xb[h][4 * i], xb[h][4 * i + 1]);
      lily::cuda::mma_bf16(d[1], a1, xb[h][4 * i + 2], xb[h][4 * i + 3]);
    }
  // Lanes c < 2: rows r, r + 8 at the window's groups 2c, 2c + 1 (D columns 2c, 2c + 1). Lanes c ≥ 2 hold zero
  // columns; they compute lane c − 2's scales and drop out at the pair sum below.
  float p[2];
#pragma unroll
  for (int m = 0; m < 2; ++m) {
    const float s0 = __uint_as_float(T.s[m] << 16), s1 = __uint_as_float(T.s[m] & 0xFFFF0000u);
    const float b0 = __uint_as_float(T.b[m] << 16) - 128.0f * s0;
    const float b1 = __uint_as_float(T.b[m] & 0xFFFF0000u) - 128.0f * s1;
    const float e0 = d[0][2 * m] + d[1][2 * m], e1 = d[0][2 * m + 1] + d[1][2 * m + 1];
    p[m] = fmaf(s0, e0, fmaf(b0, xs[0], fmaf(s1, e1, b1 * xs[1])));
    p[m] += __shfl_xor_sync(0xFFFFFFFFu, p[m], 1);
  }
  if (c == 0) part[w][r] = p[0], part[w][r + 8] = p[1];
  __syncthreads();
  if (threadIdx.x < 16) {
    float v = 0.0f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) v += part[k][threadIdx.x];
    g.y[tile * 16 + threadIdx.x] = __bfloat16_as_ushort(__float2bfloat16(v));
  }
}

__global__ void __launch_bounds__(kThreads, kBlocksPerSm) tc_kernel(const Gemv param) {
  static_assert(kK == 256 * kWarps, "a warp's window is 256 codes");
  const Gemv g = param;
  __shared__ float part[2][kWarps][16];  // by tile parity: one barrier per tile
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, r = lane >> 2, c = lane & 3, tiles = g.N / 16;
  TcTile A, B;
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  int tile = blockIdx.x;
  if (tile < tiles) tc_load(g, tile, w, r, c, A);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  uint32_t xb[2][16];
  float sum = 0.0f;  // Σx of the lane's live chunk (a lane is live in one half at most)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool live = r == 2 * h + c / 2;
    const uint4* src = reinterpret_cast<const uint4*>(g.x + (32 * (8 * w + 4 * h + c)) % g.xn);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = live ? __ldcg(src + i) : make_uint4(0, 0, 0, 0);  // x[8i .. 8i + 7] of the chunk
      xb[h][4 * i] = __byte_perm(v.x, v.z, 0x5410);      // (x0, x4)
      xb[h][4 * i + 1] = __byte_perm(v.x, v.z, 0x7632);  // (x1, x5)
      xb[h][4 * i + 2] = __byte_perm(v.y, v.w, 0x5410);  // (x2, x6)
      xb[h][4 * i + 3] = __byte_perm(v.y, v.w, 0x7632);  // (x3, x7)
      const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) sum += __uint_as_float(u[k] << 16) + __uint_as_float(u[k] & 0xFFFF0000u);
    }
  }
  // Σx of the window's group n: the live lanes (n, 2(n & 1)) and (n, 2(n & 1) + 1). Lane c keeps groups 2(c & 1), +1.
  float v[4];
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int l = 4 * n + 2 * (n & 1);
    v[n] = __shfl_sync(0xFFFFFFFFu, sum, l) + __shfl_sync(0xFFFFFFFFu, sum, l + 1);
  }
  const float xs[2] = {(c & 1) ? v[2] : v[0], (c & 1) ? v[3] : v[1]};
  while (tile < tiles) {  // two tiles per trip, so that A and B swap roles without copies
    const int t1 = tile + gridDim.x;
    if (t1 < tiles) tc_load(g, t1, w, r, c, B);
    tc_tile(g, tile, w, r, c, A, xb, xs, part[0]);
    if (t1 >= tiles) break;
    const int t2 = t1 + gridDim.x;
    if (t2 < tiles) tc_load(g, t2, w, r, c, A);
    tc_tile(g, t1, w, r, c, B, xb, xs, part[1]);
    tile = t2;
  }
}

// The reference: one warp per row, w = s·q + b formed per code, fp32 (mlx's dequantised dot, in another order).
__global__ void ref_kernel(const Gemv g, uint16_t* y) {
  const int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
  if (n >= g.N) return;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(g.w) + size_t(n) * g.K / 8;
  float acc = 0.0f;
  for (int k = lane; k < g.K; k += 32) {
    const uint32_t q = (w[k / 8] >> (4 * (k % 8))) & 15u;
    const size_t gi = size_t(n) * g.K / 64 + k / 64;
    const float wk = bits_to_f(g.s[gi]) * float(q) + bits_to_f(g.b[gi]);
    acc += wk * bits_to_f(g.x[k % g.xn]);
  }
  acc = warp_sum(acc);
  if (lane == 0) y[n] = __bfloat16_as_ushort(__float2bfloat16(acc));
}

__device__ __forceinline__ uint64_t mix(uint64_t z) {  // splitmix64
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float unit_float(uint64_t h) { return float(h >> 40) * (1.0f / 16777216.0f); }

__global__ void fill_codes(uint4* w, size_t n, uint64_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint64_t a = mix(seed ^ (2 * i)), b = mix(seed ^ (2 * i + 1));
    w[i] = make_uint4(uint32_t(a), uint32_t(a >> 32), uint32_t(b), uint32_t(b >> 32));
  }
}
// Scales (0.5 + u)/√(23·K), so that y keeps x's magnitude; biases −(7 + u)·s, so that w = s·q + b averages zero over
// codes averaging 7.5 (a mean left in w would multiply x's mean by ~K·|mean w| a GEMV and overflow the chain).
__global__ void fill_groups(uint16_t* s, uint16_t* b, size_t n, int K, uint64_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float sc = (0.5f + unit_float(mix(seed ^ (2 * i)))) / sqrtf(23.0f * K);
    s[i] = __bfloat16_as_ushort(__float2bfloat16(sc));
    b[i] = __bfloat16_as_ushort(__float2bfloat16(-(7.0f + unit_float(mix(seed ^ (2 * i + 1)))) * sc));
  }
}
__global__ void fill_x(uint16_t* x, int n, uint64_t seed) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    x[i] = __bfloat16_as_ushort(__float2bfloat16(3.4f * unit_float(mix(seed ^ i)) - 1.7f));
}

struct Chain {
  const char* name;
  std::vector<Gemv> gemvs;  // host copy
  Gemv* dev = nullptr;
  uint16_t* ys = nullptr;   // every output, one after another
  size_t y_elems = 0;
  double bytes = 0;         // weight bytes of a step
};

Chain make_chain(const char* name, const std::vector<std::pair<int, int>>& layer, int layers, int x0n, uint64_t seed) {
  Chain ch;
  ch.name = name;
  size_t chunks = 0, groups = 0;
  for (int l = 0; l < layers; ++l)
    for (auto [N, K] : layer) chunks += size_t(N) * K / 32, groups += size_t(N) * K / 64, ch.y_elems += N;
  uint4* w;
  uint16_t *s, *b, *x0;
  CHECK(cudaMalloc(&w, chunks * 16));
  CHECK(cudaMalloc(&s, groups * 2));
  CHECK(cudaMalloc(&b, groups * 2));
  CHECK(cudaMalloc(&x0, size_t(x0n) * 2));
  CHECK(cudaMalloc(&ch.ys, ch.y_elems * 2));
  fill_codes<<<1024, 256>>>(w, chunks, seed);
  fill_x<<<16, 256>>>(x0, x0n, seed + 1);
  size_t wc = 0, gc = 0, yc = 0;
  const uint16_t* x = x0;
  int xn = x0n;
  for (int l = 0; l < layers; ++l)
    for (auto [N, K] : layer) {
      fill_groups<<<256, 256>>>(s + gc, b + gc, size_t(N) * K / 64, K, seed + 2 + ch.gemvs.size());
      Gemv g{w + wc, s + gc, b + gc, x, xn, ch.ys + yc, N, K};
      ch.gemvs.push_back(g);
      ch.bytes += double(N) * K / 2 + double(N) * K / 64 * 4;
      wc += size_t(N) * K / 32, gc += size_t(N) * K / 64, yc += N;
      x = g.y, xn = N;
    }
  CHECK(cudaGetLastError());
  CHECK(cudaMalloc(&ch.dev, ch.gemvs.size() * sizeof(Gemv)));
  CHECK(cudaMemcpy(ch.dev, ch.gemvs.data(), ch.gemvs.size() * sizeof(Gemv), cudaMemcpyHostToDevice));
  return ch;
}

enum Variant { kGraph, kPdl, kPdl2, kPersist, kPersist2, kFlags, kFloor, kTc, kVariants };
const char* kNames[kVariants] = {"graph", "pdl", "pdl2", "persist", "persist2", "flags", "floor", "tc"};

// Lily's own launch (common.cuh: the PDL attribute when ctx.pdl), the grid sized as qmv.cu's launch_stream sizes it:
// the resident blocks, or fewer when the GEMV has fewer units than warps.
void launch_gemv(cudaStream_t st, int grid, const Gemv& g, bool pdl, int pre) {
  lily::cuda::Ctx ctx;
  ctx.stream = st;
  ctx.pdl = pdl;
  grid = std::min(grid, (g.N / kRpu + kWarps - 1) / kWarps);
  lily::cuda::launch(ctx, pre == 2 ? gemv_kernel<2> : gemv_kernel<1>, grid, kThreads, 0, g);
}
void launch_tc(cudaStream_t st, int grid, const Gemv& g) {
  lily::cuda::Ctx ctx;
  ctx.stream = st;
  ctx.pdl = true;
  lily::cuda::launch(ctx, tc_kernel, std::min(grid, g.N / 16), kThreads, 0, g);
}

cudaGraphExec_t capture(cudaStream_t st, const Chain& ch, Variant v, int grid, unsigned* done) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  const int n = int(ch.gemvs.size());
  if (v == kFloor) {
    persist_kernel<2, 0><<<grid, kThreads, 0, st>>>(ch.dev, n, done);
    CHECK(cudaGetLastError());
  } else if (v == kFlags) {
    CHECK(cudaMemsetAsync(done, 0, sizeof(unsigned) * n * grid, st));
    persist_kernel<2, 2><<<grid, kThreads, 0, st>>>(ch.dev, n, done);
    CHECK(cudaGetLastError());
  } else if (v == kPersist || v == kPersist2) {
    CHECK(cudaMemsetAsync(done, 0, sizeof(unsigned) * n, st));
    if (v == kPersist)
      persist_kernel<1><<<grid, kThreads, 0, st>>>(ch.dev, n, done);
    else
      persist_kernel<2><<<grid, kThreads, 0, st>>>(ch.dev, n, done);
    CHECK(cudaGetLastError());
  } else if (v == kTc) {
    for (const Gemv& gm : ch.gemvs) launch_tc(st, grid, gm);
  } else {
    for (const Gemv& gm : ch.gemvs) launch_gemv(st, grid, gm, v != kGraph, v == kPdl2 ? 2 : 1);
  }
  CHECK(cudaStreamEndCapture(st, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  CHECK(cudaGraphDestroy(g));
  return ge;
}

float bf(uint16_t v) {
  const uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Runs v once on poisoned outputs; checks every GEMV against the reference fed the variant's own input, and the
// outputs bit for bit against `first` (the first variant's) unless v is `tc`. Returns false on a failure.
bool check(cudaStream_t st, const Chain& ch, cudaGraphExec_t ge, Variant v, std::vector<uint16_t>& first) {
  CHECK(cudaMemsetAsync(ch.ys, 0xFF, ch.y_elems * 2, st));  // bf16 NaN
  CHECK(cudaGraphLaunch(ge, st));
  CHECK(cudaStreamSynchronize(st));
  std::vector<uint16_t> out(ch.y_elems), ref(ch.y_elems);
  CHECK(cudaMemcpy(out.data(), ch.ys, ch.y_elems * 2, cudaMemcpyDeviceToHost));
  uint16_t* ref_dev;
  CHECK(cudaMalloc(&ref_dev, ch.y_elems * 2));
  size_t at = 0;
  for (const Gemv& g : ch.gemvs) {
    ref_kernel<<<(g.N + 7) / 8, 256, 0, st>>>(g, ref_dev + at);
    at += g.N;
  }
  CHECK(cudaGetLastError());
  CHECK(cudaStreamSynchronize(st));
  CHECK(cudaMemcpy(ref.data(), ref_dev, ch.y_elems * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaFree(ref_dev));
  double worst = 0;
  at = 0;
  for (const Gemv& g : ch.gemvs) {
    double e2 = 0, r2 = 0;
    for (int i = 0; i < g.N; ++i) {
      const double o = bf(out[at + i]), r = bf(ref[at + i]);
      if (!std::isfinite(o)) {
        std::printf("FAIL %s %s: GEMV %td row %d not written or not finite\n", ch.name, kNames[v],
                    &g - ch.gemvs.data(), i);
        return false;
      }
      e2 += (o - r) * (o - r), r2 += r * r;
    }
    worst = std::max(worst, std::sqrt(e2 / std::max(r2, 1e-30)));
    at += g.N;
  }
  if (worst > 1e-2) {
    std::printf("FAIL %s %s: relative error %.3g against the reference\n", ch.name, kNames[v], worst);
    return false;
  }
  if (v == kTc) {
    std::printf("ok   %-6s %-9s worst relative error %.2e\n", ch.name, kNames[v], worst);
    return true;
  }
  if (first.empty()) {
    first = out;
  } else if (out != first) {
    size_t i = 0;
    while (out[i] == first[i]) ++i;
    std::printf("FAIL %s %s: output %zu differs from %s's\n", ch.name, kNames[v], i, kNames[0]);
    return false;
  }
  std::printf("ok   %-6s %-9s worst relative error %.2e, bitwise equal to graph\n", ch.name, kNames[v], worst);
  return true;
}

}  // namespace

int main() {
  int sms = 0, occ = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, persist_kernel<2>, kThreads, 0));
  int occ1 = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ1, persist_kernel<1>, kThreads, 0));
  int occ_tc = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ_tc, tc_kernel, kThreads, 0));
  occ = std::min({occ, occ1, kBlocksPerSm});
  if (occ_tc < occ) std::printf("note: tc_kernel fits %d blocks per SM, not %d\n", occ_tc, occ);
  if (occ < 1) {
    std::printf("FAIL: the persistent kernel does not fit an SM\n");
    return 1;
  }
  const int grid = sms * occ;  // every block resident at once: the spin waits cannot deadlock
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  unsigned* done;
  CHECK(cudaMalloc(&done, sizeof(unsigned) * 256 * grid));  // a flag per block and GEMV (variant flags)
  std::vector<Chain> chains;
  chains.push_back(make_chain("layer", {{12352, kK}, {4096, kK}, {512, kK}, {9216, kK}, {4096, kK}}, 40,
                              kK, 11));
  chains.push_back(make_chain("tiny", {{256, kK}}, 200, kK, 12));
  CHECK(cudaDeviceSynchronize());
  std::printf("%d SMs, %d blocks of %d threads (%d per SM)\n", sms, grid, kThreads, occ);
  bool ok = true;
  double t[2][kVariants][2];
  for (size_t c = 0; c < chains.size(); ++c) {
    cudaGraphExec_t ge[kVariants];
    std::vector<uint16_t> first;
    for (int v = 0; v < kVariants; ++v) {
      ge[v] = capture(st, chains[c], Variant(v), grid, done);
      if (v != kFloor) ok = check(st, chains[c], ge[v], Variant(v), first) && ok;
    }
    for (int rep = 0; rep < 2; ++rep)  // two rounds, interleaved: their spread is the noise
      for (int v = 0; v < kVariants; ++v) t[c][v][rep] = graph_median_us(st, ge[v]);
    for (int v = 0; v < kVariants; ++v) CHECK(cudaGraphExecDestroy(ge[v]));
  }
  std::printf("\n%-6s %-9s %12s %12s %10s %8s\n", "chain", "variant", "µs/step", "µs/GEMV", "TB/s", "vs pdl");
  for (size_t c = 0; c < chains.size(); ++c) {
    const double n = double(chains[c].gemvs.size());
    for (int v = 0; v < kVariants; ++v) {
      const double us = std::min(t[c][v][0], t[c][v][1]), pdl = std::min(t[c][kPdl][0], t[c][kPdl][1]);
      std::printf("%-6s %-9s %6.1f/%-6.1f %12.3f %10.2f %+7.1f%%\n", chains[c].name, kNames[v], t[c][v][0], t[c][v][1],
                  us / n, chains[c].bytes / us / 1e6, 100.0 * (pdl / us - 1.0));
    }
  }
  std::printf("%s\n", ok ? "all checks passed" : "CHECKS FAILED");
  return ok ? 0 : 1;
}
