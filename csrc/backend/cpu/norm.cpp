// norm.cpp: RMSNorm, the fused residual-add + RMSNorm, and Gated DeltaNet's gated RMSNorm
// (architecture.md §3.1, §5.8).
//
// Math    rms_norm:  y = x / sqrt(mean(x²) + eps) · w        (MLX checkpoints store w already shifted, 1 + w)
//         gdn_norm:  o = y / sqrt(mean(y²) + eps) · w · silu(z)  per value head of DV values
#include <cmath>

#include "backend/cpu/ops.h"

namespace lily::cpu {

static void norm_row(const float* x, const float* w, int n, float eps, float* out) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  float r = 1.0f / std::sqrt(ss / float(n) + eps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * r * w[i];
}

void rms_norm(const float* x, const float* w, int T, int H, float eps, float* out) {
  for (int t = 0; t < T; ++t) norm_row(x + size_t(t) * H, w, H, eps, out + size_t(t) * H);
}

void add_rms_norm(float* x, const float* d, const float* w, int T, int H, float eps, float* out) {
  for (size_t i = 0; i < size_t(T) * H; ++i) x[i] += d[i];
  rms_norm(x, w, T, H, eps, out);
}

void gdn_norm(const GdnArgs& a, const float* y, const float* z, const float* w, float* out) {
  const size_t rows = size_t(a.T) * a.NV;
  for (size_t r = 0; r < rows; ++r) {
    const size_t o = r * a.DV;
    norm_row(y + o, w, a.DV, a.eps, out + o);
    for (int i = 0; i < a.DV; ++i) out[o + i] *= silu(z[o + i]);
  }
}

}  // namespace lily::cpu
