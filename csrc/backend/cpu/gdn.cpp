// gdn.cpp: Gated DeltaNet conv and recurrence on the CPU (architecture.md §5.2–§5.7).
//
// Math    conv:  C[t, c] = silu(Σ_{k<K} w[c, k] · U[t + k, c]),  U = [state (K−1 rows); x]; state ← last K−1 rows of U.
//         scan, per value head h (key head h / (NV/NK)), token by token:
//           q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK),  k̂ = k / sqrt(Σk² + 1e-6),  β = σ(b),
//           g = exp(−exp(A_log) · softplus(α + dt_bias));
//           S ← g·S;  u = S·k̂;  δ = β·(v − u);  S ← S + δ ⊗ k̂;  y = S·q̂     (S is [DV, DK], fp32)
// Mapping one value head per task; the state is walked row by row (decay, read, write and output fused per row,
//         which is the same arithmetic as the four matrix steps).
#include <cmath>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/parallel.h"

namespace lily::cpu {

void gdn_conv(const GdnArgs& a, const float* x, const float* w, float* conv_state, float* out) {
  const int C = 2 * a.NK * a.DK + a.NV * a.DV, K = a.conv_kernel, S = K - 1;
  // U rows: 0..S-1 from the state, S..S+T-1 from x.
  auto U = [&](int r, int c) { return r < S ? conv_state[size_t(r) * C + c] : x[size_t(r - S) * C + c]; };
  parallel_for(C, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      for (int t = 0; t < a.T; ++t) {
        float acc = 0.0f;
        for (int k = 0; k < K; ++k) acc += w[size_t(c) * K + k] * U(t + k, int(c));
        out[size_t(t) * C + c] = silu(acc);
      }
      float keep[8];  // K ≤ 9 (checked at load)
      for (int r = 0; r < S; ++r) keep[r] = U(a.T + r, int(c));
      for (int r = 0; r < S; ++r) conv_state[size_t(r) * C + c] = keep[r];
    }
  });
}

static float softplus(float x) { return std::max(x, 0.0f) + std::log1p(std::exp(-std::fabs(x))); }

static void l2_normalize(const float* x, int n, float scale, float* out) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  float r = scale / std::sqrt(ss + 1e-6f);
  for (int i = 0; i < n; ++i) out[i] = x[i] * r;
}

void gdn_scan(const GdnArgs& a, const float* c, const float* b, const float* alpha, const float* A_log,
              const float* dt_bias, float* state, float* y) {
  const int C = 2 * a.NK * a.DK + a.NV * a.DV, r = a.NV / a.NK;
  const float q_scale = 1.0f / std::sqrt(float(a.DK));
  parallel_for(a.NV, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> q(a.DK), k(a.DK);
    for (int64_t h = h0; h < h1; ++h) {
      const int kh = int(h) / r;
      float* S = state + size_t(h) * a.DV * a.DK;
      for (int t = 0; t < a.T; ++t) {
        const float* row = c + size_t(t) * C;
        l2_normalize(row + size_t(kh) * a.DK, a.DK, q_scale, q.data());
        l2_normalize(row + size_t(a.NK + kh) * a.DK, a.DK, 1.0f, k.data());
        const float* v = row + size_t(2 * a.NK) * a.DK + size_t(h) * a.DV;
        const float beta = sigmoid(b[size_t(t) * a.NV + h]);
        const float g = std::exp(-std::exp(A_log[h]) * softplus(alpha[size_t(t) * a.NV + h] + dt_bias[h]));
        float* yt = y + (size_t(t) * a.NV + h) * a.DV;
        for (int i = 0; i < a.DV; ++i) {
          float* Si = S + size_t(i) * a.DK;
          float u = 0.0f;
          for (int j = 0; j < a.DK; ++j) u += (Si[j] *= g) * k[j];  // decay, then read S·k̂
          const float delta = beta * (v[i] - u);                     // delta-rule error
          float out = 0.0f;
          for (int j = 0; j < a.DK; ++j) out += (Si[j] += delta * k[j]) * q[j];  // write, then read S·q̂
          yt[i] = out;
        }
      }
    }
  });
}

}  // namespace lily::cpu
