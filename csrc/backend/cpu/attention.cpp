// attention.cpp: the gated full-attention mixer on the CPU (architecture.md §4, §3.4, §8).
//
// Math    per head h: q_h, g_h = qg[t, h, :HD], qg[t, h, HD:]; q ← RMSNorm(q; q_norm), k ← RMSNorm(k; k_norm);
//         RoPE on dims 0..R-1 with rotate-half pairing (i, i+R/2), θ_i = theta^(−2i/R), angle p·θ_i;
//         K/V rows appended at p = pos0 + t; o_h = softmax(q·Kᵀ / sqrt(HD), causal) · V using kv head h / (NH/NKV);
//         out = o ⊙ σ(g).
// Layout  qg [T, NH, 2·HD]; k, v [T, NKV·HD]; caches [cap, NKV, HD]; out [T, NH·HD].
// Mapping the query rows of one kv head, r = t·G + g for head kvh·G + g (G = NH/NKV), in blocks of kLanes (16): a
//         block's queries are the lanes of two gemm calls, S = K·Qᵀ over the keys up to the block's last position,
//         then Oᵀ = Vᵀ·P, with the causal softmax per row in between (masked keys get probability 0, which adds
//         nothing). Every sum runs over the head dimension or the keys in order, as a per-query loop would. Blocks
//         are split across threads; q/k preparation is split by token.
// History v1 one (token, head) per task, scalar dot products · v2 16 query rows per block through gemm (current).
#include <cmath>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/common.h"
#include "core/parallel.h"

namespace lily::cpu {

static void head_norm(float* x, const float* w, int n, float eps) {
  float ss = 0.0f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  float r = 1.0f / std::sqrt(ss / float(n) + eps);
  for (int i = 0; i < n; ++i) x[i] = x[i] * r * w[i];
}

static void rope(float* x, int pos, int R, float theta) {
  const int half = R / 2;
  for (int i = 0; i < half; ++i) {
    float inv_freq = std::pow(theta, -2.0f * float(i) / float(R));
    float angle = float(pos) * inv_freq;
    float c = std::cos(angle), s = std::sin(angle);
    float x0 = x[i], x1 = x[i + half];
    x[i] = x0 * c - x1 * s;
    x[i + half] = x1 * c + x0 * s;
  }
}

void attention(const AttnArgs& a, const float* qg, const float* k, const float* v, const float* q_norm,
               const float* k_norm, float* k_cache, float* v_cache, float* out) {
  const int HD = a.HD, kv_row = a.NKV * HD, G = a.NH / a.NKV;
  const int pos0 = a.pos_dev ? *a.pos_dev : a.pos0;  // host memory here: the device copy is readable
  // 1. q: split, norm, rotate (into a scratch buffer [T, NH, HD]); k, v: norm, rotate, append to the caches.
  std::vector<float> q(size_t(a.T) * a.NH * HD);
  parallel_for(a.T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int pos = pos0 + int(t);
      for (int h = 0; h < a.NH; ++h) {
        float* qh = q.data() + (size_t(t) * a.NH + h) * HD;
        const float* src = qg + (size_t(t) * a.NH + h) * 2 * HD;
        for (int i = 0; i < HD; ++i) qh[i] = src[i];
        head_norm(qh, q_norm, HD, a.eps);
        rope(qh, pos, a.rotary_dim, a.rope_theta);
      }
      for (int h = 0; h < a.NKV; ++h) {
        float* kh = k_cache + size_t(pos) * kv_row + size_t(h) * HD;
        float* vh = v_cache + size_t(pos) * kv_row + size_t(h) * HD;
        for (int i = 0; i < HD; ++i) {
          kh[i] = k[size_t(t) * kv_row + size_t(h) * HD + i];
          vh[i] = v[size_t(t) * kv_row + size_t(h) * HD + i];
        }
        head_norm(kh, k_norm, HD, a.eps);
        rope(kh, pos, a.rotary_dim, a.rope_theta);
      }
    }
  });
  // 2. causal softmax attention over blocks of kLanes query rows of one kv head, then the sigmoid output gate.
  const float scale = 1.0f / std::sqrt(float(HD));
  const int rows = a.T * G;
  const int64_t blocks = ceil_div(rows, kLanes);
  parallel_for(a.NKV * blocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> qt(size_t(HD) * kLanes), s, ot(size_t(HD) * kLanes);
    float sum[kLanes];
    for (int64_t i = i0; i < i1; ++i) {
      const int kvh = int(i / blocks), r0 = int(i % blocks) * kLanes, nr = std::min(kLanes, rows - r0);
      const int n_max = pos0 + (r0 + nr - 1) / G + 1;  // keys seen by the block's last row
      // Qᵀ [HD, kLanes]; lanes past the last row are zero.
      for (int r = 0; r < kLanes; ++r) {
        const int t = (r0 + r) / G, h = kvh * G + (r0 + r) % G;
        for (int d = 0; d < HD; ++d) qt[size_t(d) * kLanes + r] = r < nr ? q[(size_t(t) * a.NH + h) * HD + d] : 0.0f;
      }
      // S [n_max, kLanes]: S[j, r] = k_j · q_r.
      s.resize(size_t(n_max) * kLanes);
      gemm(k_cache + size_t(kvh) * HD, kv_row, 1, n_max, qt.data(), kLanes, HD, s.data(), kLanes, kLanes);
      // P: softmax of each row over its own keys (0 .. pos0 + t); the rest, and unused lanes, get 0.
      for (int r = 0; r < kLanes; ++r) {
        const int n_keys = r < nr ? pos0 + (r0 + r) / G + 1 : 0;
        float mx = -INFINITY;
        for (int j = 0; j < n_keys; ++j) mx = std::max(mx, s[size_t(j) * kLanes + r] *= scale);
        sum[r] = 0.0f;
        for (int j = 0; j < n_keys; ++j) sum[r] += (s[size_t(j) * kLanes + r] = std::exp(s[size_t(j) * kLanes + r] - mx));
        for (int j = n_keys; j < n_max; ++j) s[size_t(j) * kLanes + r] = 0.0f;
      }
      // Oᵀ [HD, kLanes]: Oᵀ[d, r] = Σ_j V[j, d] · P[j, r].
      gemm(v_cache + size_t(kvh) * HD, 1, kv_row, HD, s.data(), kLanes, n_max, ot.data(), kLanes, kLanes);
      for (int r = 0; r < nr; ++r) {
        const int t = (r0 + r) / G, h = kvh * G + (r0 + r) % G;
        const float* gate = qg + (size_t(t) * a.NH + h) * 2 * HD + HD;
        float* dst = out + (size_t(t) * a.NH + h) * HD;
        for (int d = 0; d < HD; ++d) dst[d] = ot[size_t(d) * kLanes + r] / sum[r] * sigmoid(gate[d]);
      }
    }
  });
}

}  // namespace lily::cpu
