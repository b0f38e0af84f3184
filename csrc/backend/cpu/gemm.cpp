// gemm.cpp: the inner kernel of the CPU backend's blocked loops (ops.h): a small fp32 matrix product whose kLanes
// output columns are the vector lanes. qmm multiplies tokens into a dequantised weight tile with it, attention
// multiplies keys into a tile of query rows and values into a tile of probabilities.
//
// Math    y[i, c] = Σ_{k<K} x[i, k] · w[k, c], each sum over k in order (the same fp32 sum as a plain dot product).
// Mapping 4 rows of x at a time: 4 × kLanes accumulators; per k, 4 scalars of x times one kLanes-wide row of w. The
//         lane loops are unrolled so that the compiler vectorises across columns; no sum is reordered.
// Cost    2·n·K·kLanes FLOP for (n + kLanes)·K loads; 25–30 GFLOP/s per core with 128-bit vectors (x86-64 baseline).
#include "backend/cpu/ops.h"

namespace lily::cpu {
namespace {

template <int kRows>
void gemm_rows(const float* x, size_t xi, size_t xk, const float* w, size_t ws, int K, float* y, size_t ys, int cols) {
  float acc[kRows][kLanes] = {};
  for (int k = 0; k < K; ++k) {
    const float* wk = w + size_t(k) * ws;
    const float* xk_col = x + size_t(k) * xk;
    LILY_UNROLL_LANES for (int i = 0; i < kRows; ++i) {
      const float xv = xk_col[size_t(i) * xi];
      LILY_UNROLL_LANES for (int c = 0; c < kLanes; ++c) acc[i][c] += xv * wk[c];
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int c = 0; c < cols; ++c) y[size_t(i) * ys + c] = acc[i][c];
}

}  // namespace

void gemm(const float* x, size_t xi, size_t xk, int n, const float* w, size_t ws, int K, float* y, size_t ys,
          int cols) {
  int i = 0;
  for (; i + 4 <= n; i += 4) gemm_rows<4>(x + i * xi, xi, xk, w, ws, K, y + i * ys, ys, cols);
  const float* xr = x + i * xi;
  float* yr = y + i * ys;
  switch (n - i) {
    case 3: gemm_rows<3>(xr, xi, xk, w, ws, K, yr, ys, cols); break;
    case 2: gemm_rows<2>(xr, xi, xk, w, ws, K, yr, ys, cols); break;
    case 1: gemm_rows<1>(xr, xi, xk, w, ws, K, yr, ys, cols); break;
    default: break;
  }
}

}  // namespace lily::cpu
