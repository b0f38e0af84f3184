// attention.cpp: the gated full-attention mixer on the CPU (architecture.md §4, §3.4, §8).
//
// Math    per head h: q_h, g_h = qg[t, h, :HD], qg[t, h, HD:]; q ← RMSNorm(q; q_norm), k ← RMSNorm(k; k_norm);
//         RoPE on dims 0..R-1 with rotate-half pairing (i, i+R/2), θ_i = theta^(−2i/R), angle p·θ_i;
//         K/V rows appended at p = pos0 + t; o_h = softmax(q·Kᵀ / sqrt(HD), causal) · V using kv head h / (NH/NKV);
//         out = o ⊙ σ(g).
// Layout  qg [T, NH, 2·HD]; k, v [T, NKV·HD]; caches [cap, NKV, HD]; out [T, NH·HD].
#include <cmath>
#include <vector>

#include "backend/cpu/ops.h"
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
  const int HD = a.HD, kv_row = a.NKV * HD, group = a.NH / a.NKV;
  const int pos0 = a.pos_dev ? *a.pos_dev : a.pos0;  // host memory here: the device copy is readable
  // 1. q: split, norm, rotate (into a scratch buffer [T, NH, HD]); k, v: norm, rotate, append to the caches.
  std::vector<float> q(size_t(a.T) * a.NH * HD);
  for (int t = 0; t < a.T; ++t) {
    const int pos = pos0 + t;
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
  // 2. causal softmax attention, one (token, head) pair per task, then the sigmoid output gate.
  const float scale = 1.0f / std::sqrt(float(HD));
  parallel_for(int64_t(a.T) * a.NH, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p(pos0 + a.T);
    std::vector<float> o(HD);
    for (int64_t i = i0; i < i1; ++i) {
      const int t = int(i / a.NH), h = int(i % a.NH), kvh = h / group, n_keys = pos0 + t + 1;
      const float* qh = q.data() + size_t(i) * HD;
      float mx = -INFINITY;
      for (int j = 0; j < n_keys; ++j) {
        const float* kj = k_cache + size_t(j) * kv_row + size_t(kvh) * HD;
        float s = 0.0f;
        for (int d = 0; d < HD; ++d) s += qh[d] * kj[d];
        p[j] = s * scale;
        mx = std::max(mx, p[j]);
      }
      float sum = 0.0f;
      for (int j = 0; j < n_keys; ++j) sum += (p[j] = std::exp(p[j] - mx));
      std::fill(o.begin(), o.end(), 0.0f);
      for (int j = 0; j < n_keys; ++j) {
        const float* vj = v_cache + size_t(j) * kv_row + size_t(kvh) * HD;
        for (int d = 0; d < HD; ++d) o[d] += p[j] * vj[d];
      }
      const float* gate = qg + size_t(i) * 2 * HD + HD;
      float* dst = out + size_t(i) * HD;
      for (int d = 0; d < HD; ++d) dst[d] = o[d] / sum * sigmoid(gate[d]);
    }
  });
}

}  // namespace lily::cpu
