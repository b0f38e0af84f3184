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
//   floor      persist2 without the counters: wrong outputs (not checked), the time of the loads and arithmetic alone.
// Every checked variant runs the same arithmetic in the same order, so their outputs must agree bit for bit; each is
// also checked against a plain fp32 reference kernel per GEMV (each row's dequantised dot, fed the variant's own
// input, so errors do not compound), outputs poisoned with NaN first.
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

// WAIT false (variant `floor`): no counters at all, so a block reads x whatever its state: wrong outputs, but the time
// of the chain's loads and arithmetic alone, the floor any ordering between the GEMVs can reach.
template <int PRE, bool WAIT = true>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) persist_kernel(const Gemv* chain, int n, unsigned* done) {
  __shared__ float4 xs[kK / 4];
  __shared__ float xsum[kK / 32];
  const int lane = threadIdx.x & 31, warps = gridDim.x * kWarps, u = blockIdx.x * kWarps + (threadIdx.x >> 5);
  Unit A, B;
  preload<PRE>(chain[0], u, warps, lane, A, B);
  for (int s = 0; s < n; ++s) {
    const Gemv g = chain[s];
    if (WAIT && s > 0) {  // every block has written GEMV s − 1's rows
      if (threadIdx.x == 0)
        while (ld_acquire(done + s - 1) < gridDim.x) {
        }
      __syncthreads();
    }
    stage_x(g, xs, xsum);
    __syncthreads();
    run_units(g, u, warps, lane, A, B, PRE == 2, xs, xsum);
    if (s + 1 < n) preload<PRE>(chain[s + 1], u, warps, lane, A, B);  // weights: no dependency
    __syncthreads();  // the block's rows written, and its x reads done
    if (WAIT && threadIdx.x == 0) {
      __threadfence();
      atomicAdd(done + s, 1u);
    }
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
// Scales (0.5 + u)/√(23·K), so that y keeps x's magnitude; biases −(7.5 + u)·s (codes average 7.5).
__global__ void fill_groups(uint16_t* s, uint16_t* b, size_t n, int K, uint64_t seed) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float sc = (0.5f + unit_float(mix(seed ^ (2 * i)))) / sqrtf(23.0f * K);
    s[i] = __bfloat16_as_ushort(__float2bfloat16(sc));
    b[i] = __bfloat16_as_ushort(__float2bfloat16(-(7.5f + unit_float(mix(seed ^ (2 * i + 1)))) * sc));
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

enum Variant { kGraph, kPdl, kPdl2, kPersist, kPersist2, kFloor, kVariants };
const char* kNames[kVariants] = {"graph", "pdl", "pdl2", "persist", "persist2", "floor"};

// Lily's own launch (common.cuh: the PDL attribute when ctx.pdl), the grid sized as qmv.cu's launch_stream sizes it:
// the resident blocks, or fewer when the GEMV has fewer units than warps.
void launch_gemv(cudaStream_t st, int grid, const Gemv& g, bool pdl, int pre) {
  lily::cuda::Ctx ctx;
  ctx.stream = st;
  ctx.pdl = pdl;
  grid = std::min(grid, (g.N / kRpu + kWarps - 1) / kWarps);
  lily::cuda::launch(ctx, pre == 2 ? gemv_kernel<2> : gemv_kernel<1>, grid, kThreads, 0, g);
}

cudaGraphExec_t capture(cudaStream_t st, const Chain& ch, Variant v, int grid, unsigned* done) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  const int n = int(ch.gemvs.size());
  if (v == kFloor) {
    persist_kernel<2, false><<<grid, kThreads, 0, st>>>(ch.dev, n, done);
    CHECK(cudaGetLastError());
  } else if (v == kPersist || v == kPersist2) {
    CHECK(cudaMemsetAsync(done, 0, sizeof(unsigned) * n, st));
    if (v == kPersist)
      persist_kernel<1><<<grid, kThreads, 0, st>>>(ch.dev, n, done);
    else
      persist_kernel<2><<<grid, kThreads, 0, st>>>(ch.dev, n, done);
    CHECK(cudaGetLastError());
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
// outputs bit for bit against `first` (the first variant's). Returns false on a failure.
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
  occ = std::min({occ, occ1, kBlocksPerSm});
  if (occ < 1) {
    std::printf("FAIL: the persistent kernel does not fit an SM\n");
    return 1;
  }
  const int grid = sms * occ;  // every block resident at once: the spin waits cannot deadlock
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  unsigned* done;
  CHECK(cudaMalloc(&done, sizeof(unsigned) * 256));
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
