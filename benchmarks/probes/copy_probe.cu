// copy_probe.cu: how fast one block per SM pulls data into shared memory on this GPU, by bulk copies
// (cp.async.bulk, completing on an mbarrier) and by plain 16-byte loads (benchmarks/NOTES.md, session 45).
//   whole:  132 blocks each fill 108 KB of shared memory (the share of the GDN input projections' 14.2 MB that
//           qmv_stage gave a block), eight times over distinct data (113 MB a launch, beyond the 50 MB L2):
//           bulk copies of 1 KB to 108 KB issued by one lane or 32, against 16-byte loads 4 or 8 in flight a thread.
//   attention: decode attention's K/V stream at 32K keys (2 kv heads, HD 256, 64-key tiles, 3 stages, 128 blocks
//           of one split each): cp.async by 128 or 256 threads (attn_mma_kernel's way) against a bulk copy per
//           512-byte row. Times per launch include the launch (the `empty` rows).
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o copy_probe copy_probe.cu   Run: ./copy_probe
#include <cstdio>
#include <cstdint>
#include <cuda_runtime.h>

#define CK(x)                                                       \
  do {                                                              \
    cudaError_t e = (x);                                            \
    if (e != cudaSuccess) {                                         \
      printf("%s: %s\n", #x, cudaGetErrorString(e));                \
      return 1;                                                     \
    }                                                               \
  } while (0)

__device__ __forceinline__ uint32_t su(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// ---- whole: a block's 108 KB -------------------------------------------------------------------------------------
constexpr int kBytes = 108 * 1024;
constexpr int kPhases = 8;
// Copies of `piece` bytes, issued by `issuers` lanes of warp 0, all on one mbarrier.
__global__ void __launch_bounds__(512, 1) bulk(const char* src, int piece, int issuers, unsigned long long* sink) {
  extern __shared__ __align__(128) unsigned char sm[];
  __shared__ __align__(8) unsigned long long bar;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su(&bar)));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  for (int ph = 0; ph < kPhases; ++ph) {
  const char* s = src + (size_t(ph) * gridDim.x + blockIdx.x) * kBytes;
  if (threadIdx.x == 0)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su(&bar)), "r"(kBytes) : "memory");
  __syncwarp();
  if (threadIdx.x < issuers) {
    for (int o = threadIdx.x * piece; o < kBytes; o += issuers * piece)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                       su(sm + o)), "l"(s + o), "r"(piece), "r"(su(&bar)) : "memory");
  }
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(su(&bar)), "r"(ph & 1) : "memory");
  __syncthreads();
  }
  if (threadIdx.x == 0 && sm[blockIdx.x & 1023] == 0x7f) *sink = 1;
}
// Plain 16-byte loads into registers, then shared memory: `inflight` loads per thread before storing.
template <int INF>
__global__ void __launch_bounds__(512, 1) ldg(const char* src, unsigned long long* sink) {
  extern __shared__ __align__(128) unsigned char sm[];
  uint4* d = reinterpret_cast<uint4*>(sm);
  const int n = kBytes / 16;
  for (int ph = 0; ph < kPhases; ++ph) {
  const uint4* s = reinterpret_cast<const uint4*>(src + (size_t(ph) * gridDim.x + blockIdx.x) * kBytes);
  for (int base = threadIdx.x; base < n; base += 512 * INF) {
    uint4 r[INF];
#pragma unroll
    for (int j = 0; j < INF; ++j) r[j] = base + 512 * j < n ? __ldg(s + base + 512 * j) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < INF; ++j) if (base + 512 * j < n) d[base + 512 * j] = r[j];
  }
  __syncthreads();
  }
  if (threadIdx.x == 0 && sm[blockIdx.x & 1023] == 0x7f) *sink = 1;
}
__global__ void empty(unsigned long long* sink) { if (threadIdx.x == 999) *sink = 2; }


// ---- attention: 64-key K/V tiles at 32K keys ----------------------------------------------------------------------
constexpr int HD = 256, NKV = 2, KEYS = 32768, SPLITS = 64, SK = KEYS / SPLITS, BC = 64, NST = 3, LD = HD + 8;
constexpr int NT = SK / BC;  // tiles per block
constexpr size_t SMEM = size_t(NST) * 2 * BC * LD * 2;

template <int THREADS>
__global__ void __launch_bounds__(THREADS, 1) cpasync(const uint16_t* kc, const uint16_t* vc, float* sink) {
  extern __shared__ __align__(128) unsigned char sm_raw[];
  uint16_t* sm = reinterpret_cast<uint16_t*>(sm_raw);
  const int kvh = blockIdx.x % NKV, k0 = (blockIdx.x / NKV) * SK, tid = threadIdx.x;
  auto load = [&](int it) {
    if (it < NT) {
      uint16_t* ks = sm + (it % NST) * 2 * BC * LD;
      uint16_t* vs = ks + BC * LD;
      for (int i = tid; i < BC * 32; i += THREADS) {
        const int row = i / 32, c = i % 32;
        const size_t src = (size_t(k0 + it * BC + row) * NKV + kvh) * HD + c * 8;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(su(ks + row * LD + c * 8)), "l"(kc + src));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(su(vs + row * LD + c * 8)), "l"(vc + src));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  float acc = 0.0f;
  for (int s = 0; s < NST - 1; ++s) load(s);
  for (int it = 0; it < NT; ++it) {
    load(it + NST - 1);
    asm volatile("cp.async.wait_group %0;" ::"n"(NST - 1));
    __syncthreads();
    acc += float(sm[(it % NST) * 2 * BC * LD + (tid % BC) * LD + tid % HD]);
    __syncthreads();
  }
  if (acc == 12345.0f) *sink = acc;
}

__global__ void __launch_bounds__(128, 1) bulk_rows(const uint16_t* kc, const uint16_t* vc, float* sink) {
  extern __shared__ __align__(128) unsigned char sm_raw[];
  uint16_t* sm = reinterpret_cast<uint16_t*>(sm_raw);
  __shared__ __align__(8) unsigned long long bar[NST];
  const int kvh = blockIdx.x % NKV, k0 = (blockIdx.x / NKV) * SK, tid = threadIdx.x;
  if (tid == 0) {
    for (int s = 0; s < NST; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto load = [&](int it) {
    if (it >= NT || tid >= 32) return;
    const int st = it % NST;
    uint16_t* ks = sm + st * 2 * BC * LD;
    uint16_t* vs = ks + BC * LD;
    if (tid == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su(&bar[st])), "r"(2 * BC * HD * 2)
                   : "memory");
    __syncwarp();
    for (int row = tid; row < BC; row += 32) {
      const size_t src = (size_t(k0 + it * BC + row) * NKV + kvh) * HD;
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                       su(ks + row * LD)), "l"(kc + src), "r"(HD * 2), "r"(su(&bar[st])) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                       su(vs + row * LD)), "l"(vc + src), "r"(HD * 2), "r"(su(&bar[st])) : "memory");
    }
  };
  float acc = 0.0f;
  for (int s = 0; s < NST - 1; ++s) load(s);
  for (int it = 0; it < NT; ++it) {
    load(it + NST - 1);
    uint32_t done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(su(&bar[it % NST])), "r"((it / NST) & 1) : "memory");
    acc += float(sm[(it % NST) * 2 * BC * LD + (tid % BC) * LD + tid % HD]);
    __syncthreads();
  }
  if (acc == 12345.0f) *sink = acc;
}


int whole() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int rounds = 4;  // distinct buffers so that L2 (50 MB) does not hold them: 16 × 14 MB
  char* buf; CK(cudaMalloc(&buf, size_t(rounds) * kPhases * sms * kBytes));
  CK(cudaMemset(buf, 1, size_t(rounds) * kPhases * sms * kBytes));
  unsigned long long* sink; CK(cudaMalloc(&sink, 8));
  CK(cudaFuncSetAttribute(bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  CK(cudaFuncSetAttribute(ldg<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  CK(cudaFuncSetAttribute(ldg<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  auto timeit = [&](const char* name, auto fn) {
    for (int i = 0; i < 20; ++i) fn(i % rounds);
    cudaEventRecord(a);
    const int reps = 320;
    for (int i = 0; i < reps; ++i) fn(i % rounds);
    cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    const double us = 1000.0 * ms / reps;
    printf("%-32s %7.2f us  %6.2f TB/s\n", name, us, double(sms) * kBytes * kPhases / us / 1e6);
  };
  timeit("empty kernel", [&](int r) { empty<<<sms, 512>>>(sink); });
  for (int piece : {1024, 4096, 9216, 27648, 110592}) for (int iss : {1, 32}) {
    if (piece * iss > kBytes && iss > 1) continue;
    char nm[64]; snprintf(nm, 64, "bulk piece %d issuers %d", piece, iss);
    timeit(nm, [&](int r) { bulk<<<sms, 512, kBytes>>>(buf + size_t(r) * kPhases * sms * kBytes, piece, iss, sink); });
  }
  auto at = [&](int r) { return buf + size_t(r) * kPhases * sms * kBytes; };
  timeit("ldg 4 in flight", [&](int r) { ldg<4><<<sms, 512, kBytes>>>(at(r), sink); });
  timeit("ldg 8 in flight", [&](int r) { ldg<8><<<sms, 512, kBytes>>>(at(r), sink); });
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  return 0;
}

int attention() {
  const size_t n = size_t(KEYS) * NKV * HD;
  uint16_t *kc, *vc; float* sink;
  CK(cudaMalloc(&kc, n * 2)); CK(cudaMalloc(&vc, n * 2)); CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(kc, 0, n * 2)); CK(cudaMemset(vc, 0, n * 2));
  CK(cudaFuncSetAttribute(cpasync<128>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(SMEM)));
  CK(cudaFuncSetAttribute(cpasync<256>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(SMEM)));
  CK(cudaFuncSetAttribute(bulk_rows, cudaFuncAttributeMaxDynamicSharedMemorySize, int(SMEM)));
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  const int blocks = SPLITS * NKV;
  auto timeit = [&](const char* name, auto fn) {
    for (int i = 0; i < 20; ++i) fn();
    cudaEventRecord(a);
    const int reps = 200;
    for (int i = 0; i < reps; ++i) fn();
    cudaEventRecord(b); cudaEventSynchronize(b);
    float ms; cudaEventElapsedTime(&ms, a, b);
    const double us = 1000.0 * ms / reps;
    printf("%-28s %7.2f us  %6.2f TB/s\n", name, us, 2.0 * n * 2 / us / 1e6);
  };
  printf("%d blocks, %zu KB smem, %d tiles each, %.1f MB\n", blocks, SMEM / 1024, NT, 4.0 * n / 1e6);
  timeit("empty", [&] { empty<<<blocks, 128>>>(reinterpret_cast<unsigned long long*>(sink)); });
  timeit("cp.async 128 threads", [&] { cpasync<128><<<blocks, 128, SMEM>>>(kc, vc, sink); });
  timeit("cp.async 256 threads", [&] { cpasync<256><<<blocks, 256, SMEM>>>(kc, vc, sink); });
  timeit("bulk rows, 32 lanes", [&] { bulk_rows<<<blocks, 128, SMEM>>>(kc, vc, sink); });
  CK(cudaGetLastError()); CK(cudaDeviceSynchronize());
  return 0;
}

int main() { return whole() || attention(); }
