// gdn.cpp: Gated DeltaNet conv and recurrence on the CPU (architecture.md §5.2–§5.7).
//
// Math    conv:  C[t, c] = silu(Σ_{k<K} w[c, k] · U[t + k, c]),  U = [state (K−1 rows); x]; state ← last K−1 rows of U.
//         scan, per value head h (key head h / (NV/NK)), token by token:
//           q̂ = q / sqrt(Σq² + 1e-6) / sqrt(DK),  k̂ = k / sqrt(Σk² + 1e-6),  β = σ(b),
//           g = exp(−exp(A_log) · softplus(α + dt_bias));
//           S ← g·S;  u = S·k̂;  δ = β·(v − u);  S ← S + δ ⊗ k̂;  y = S·q̂     (S is [DV, DK], fp32)
// Mapping one value head per task. For the call, the head's state is copied transposed, Sᵀ [DK, DV] with DV padded to
//         whole kLanes blocks, so that the DV rows of S are vector lanes: per token and per block of kLanes rows,
//         one pass over k decays S and reads u = S·k̂, a second writes δ ⊗ k̂ and reads y = S·q̂. Each row's sums
//         run over k in order, as a row-by-row loop would; the copy back ends the call.
// History v1 row by row of S, scalar dot products · v2 transposed state, 16 rows per vector pass (current).
#include <cmath>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/common.h"
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
  const int C = 2 * a.NK * a.DK + a.NV * a.DV, r = a.NV / a.NK, DK = a.DK, DV = a.DV;
  const int DVp = int(ceil_div(DV, kLanes)) * kLanes;  // padded row count of the transposed state
  const float q_scale = 1.0f / std::sqrt(float(DK));
  parallel_for(a.NV, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> q(DK), k(DK), St(size_t(DK) * DVp);
    for (int64_t h = h0; h < h1; ++h) {
      const int kh = int(h) / r;
      float* S = state + size_t(h) * DV * DK;  // [DV, DK]
      for (int j = 0; j < DK; ++j)
        for (int i = 0; i < DVp; ++i) St[size_t(j) * DVp + i] = i < DV ? S[size_t(i) * DK + j] : 0.0f;
      for (int t = 0; t < a.T; ++t) {
        const float* row = c + size_t(t) * C;
        l2_normalize(row + size_t(kh) * DK, DK, q_scale, q.data());
        l2_normalize(row + size_t(a.NK + kh) * DK, DK, 1.0f, k.data());
        const float* v = row + size_t(2 * a.NK) * DK + size_t(h) * DV;
        const float beta = sigmoid(b[size_t(t) * a.NV + h]);
        const float g = std::exp(-std::exp(A_log[h]) * softplus(alpha[size_t(t) * a.NV + h] + dt_bias[h]));
        float* yt = y + (size_t(t) * a.NV + h) * DV;
        for (int i0 = 0; i0 < DVp; i0 += kLanes) {
          float u[kLanes] = {}, delta[kLanes], out[kLanes] = {};
          for (int j = 0; j < DK; ++j) {  // decay, then read S·k̂
            float* s = St.data() + size_t(j) * DVp + i0;
            const float kj = k[j];
            LILY_UNROLL_LANES for (int l = 0; l < kLanes; ++l) u[l] += (s[l] *= g) * kj;
          }
          for (int l = 0; l < kLanes; ++l) delta[l] = i0 + l < DV ? beta * (v[i0 + l] - u[l]) : 0.0f;  // delta rule
          for (int j = 0; j < DK; ++j) {  // write, then read S·q̂
            float* s = St.data() + size_t(j) * DVp + i0;
            const float kj = k[j], qj = q[j];
            LILY_UNROLL_LANES for (int l = 0; l < kLanes; ++l) out[l] += (s[l] += delta[l] * kj) * qj;
          }
          for (int l = 0; l < kLanes && i0 + l < DV; ++l) yt[i0 + l] = out[l];
        }
      }
      for (int i = 0; i < DV; ++i)
        for (int j = 0; j < DK; ++j) S[size_t(i) * DK + j] = St[size_t(j) * DVp + i];
    }
  });
}

}  // namespace lily::cpu
