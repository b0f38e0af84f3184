// pdl_probe.cu: what programmatic dependent launch (PDL) buys a chain of small dependent GEMV-like kernels replayed
// as one CUDA graph on this GPU — the shape of Lily's decode step (~500 kernels, most reading 0.5–10 MB of weights).
//
// Each kernel k reads its own weight slice (W_k, `mb` MB, 16-byte loads spread over every SM) and the vector x_k
// written by kernel k−1, and writes x_{k+1} (one float per block). Variants, each a graph of `n` kernels:
//   plain   ordinary launches: kernel k starts when k−1 has finished and drained;
//   pdl     PDL attribute; the kernel waits for its predecessor (griddepcontrol.wait) before anything else;
//   pdl+pre PDL; the kernel loads its weights into registers first, then waits, then reads x; it lets its
//           successor launch as soon as its own loads are issued (griddepcontrol.launch_dependents).
// Build: nvcc -O3 -gencode arch=compute_90,code=sm_90 -o pdl_probe pdl_probe.cu   Run: ./pdl_probe
#include <cuda_runtime.h>

#include <cstdio>
#include <algorithm>
#include <vector>

#include "probe.cuh"

constexpr int kThreads = 256, kLoads = 4;  // 16-byte loads in flight per thread and step

template <int MODE>  // 0 plain, 1 pdl (wait first), 2 pdl with weight prefetch before the wait
__global__ void __launch_bounds__(kThreads) step(const uint4* w, size_t n16, const float* x, float* y) {
  const size_t tid = size_t(blockIdx.x) * kThreads + threadIdx.x, stride = size_t(gridDim.x) * kThreads;
  uint4 q[kLoads];
  if (MODE == 1) asm volatile("griddepcontrol.wait;" ::: "memory");
#pragma unroll
  for (int i = 0; i < kLoads; ++i) q[i] = tid + i * stride < n16 ? __ldg(w + tid + i * stride) : make_uint4(0, 0, 0, 0);
  if (MODE == 2) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  const float xv = x[blockIdx.x];
  float acc = 0.0f;
  for (size_t base = 0;; base += kLoads * stride) {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) acc += float(q[i].x ^ q[i].y ^ q[i].z ^ q[i].w) * xv;
    if (base + kLoads * stride >= n16) break;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const size_t at = tid + base + (kLoads + i) * stride;
      q[i] = at < n16 ? __ldg(w + at) : make_uint4(0, 0, 0, 0);
    }
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  __shared__ float part[kThreads / 32];
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (int i = 0; i < kThreads / 32; ++i) s += part[i];
    y[blockIdx.x] = 1e-30f * s + xv;
  }
}

template <int MODE>
cudaError_t launch(cudaStream_t st, int grid, const uint4* w, size_t n16, const float* x, float* y) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = kThreads;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = MODE ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, step<MODE>, w, n16, x, y);
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int n = 400;
  const double sizes_mb[] = {0.25, 1.0, 4.0, 16.0};
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  size_t max_bytes = size_t(16.0 * (1 << 20)) * n / 8;  // rotate over 50 distinct slices (> L2)
  uint4* w;
  CHECK(cudaMalloc(&w, max_bytes));
  CHECK(cudaMemset(w, 0x5a, max_bytes));
  float* xs;
  CHECK(cudaMalloc(&xs, sizeof(float) * 1024 * (n + 1)));
  CHECK(cudaMemset(xs, 0, sizeof(float) * 1024 * (n + 1)));
  std::printf("%8s %8s %10s %10s %10s   (µs per kernel, graph of %d kernels, %d SMs)\n", "MB", "grid", "plain",
              "pdl", "pdl+pre", n, sms);
  for (double mb : sizes_mb) {
    const size_t n16 = size_t(mb * (1 << 20)) / 16;
    const int slices = int(max_bytes / (n16 * 16));
    const int grid = int(std::min<size_t>(size_t(sms) * 4, (n16 + kThreads - 1) / kThreads));
    double t[3];
    for (int mode = 0; mode < 3; ++mode) {
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      for (int k = 0; k < n; ++k) {
        const uint4* wk = w + (k % slices) * n16;
        const float* x = xs + 1024 * k;
        float* y = xs + 1024 * (k + 1);
        cudaError_t e = mode == 0 ? launch<0>(st, grid, wk, n16, x, y)
                        : mode == 1 ? launch<1>(st, grid, wk, n16, x, y)
                                    : launch<2>(st, grid, wk, n16, x, y);
        CHECK(e);
      }
      CHECK(cudaStreamEndCapture(st, &g));
      CHECK(cudaGraphInstantiate(&ge, g, 0));
      t[mode] = graph_median_us(st, ge, 3, 10) / n;
      CHECK(cudaGraphExecDestroy(ge));
      CHECK(cudaGraphDestroy(g));
    }
    std::printf("%8.2f %8d %10.2f %10.2f %10.2f   (%.0f / %.0f / %.0f GB/s)\n", mb, grid, t[0], t[1], t[2],
                mb * 1.048576e6 / t[0] / 1e3, mb * 1.048576e6 / t[1] / 1e3, mb * 1.048576e6 / t[2] / 1e3);
  }
  return 0;
}
