// probe.cuh: what the standalone CUDA probes share (pdl_probe.cu, persist_probe.cu): a checked call that ends the
// probe with the failing line, and the median time of a replayed graph.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                               \
  do {                                                                                         \
    cudaError_t err_ = (x);                                                                    \
    if (err_ != cudaSuccess) {                                                                 \
      std::printf("CUDA error %s at line %d: %s\n", cudaGetErrorString(err_), __LINE__, #x); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

// Median µs of `reps` replays of ge on st (device events around each), after `warmup` untimed ones.
inline double graph_median_us(cudaStream_t st, cudaGraphExec_t ge, int warmup = 3, int reps = 21) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) CHECK(cudaGraphLaunch(ge, st));
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(a, st));
    CHECK(cudaGraphLaunch(ge, st));
    CHECK(cudaEventRecord(b, st));
    CHECK(cudaEventSynchronize(b));
    float m;
    CHECK(cudaEventElapsedTime(&m, a, b));
    ms.push_back(m);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return ms[ms.size() / 2] * 1000.0;
}
