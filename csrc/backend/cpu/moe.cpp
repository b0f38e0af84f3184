// moe.cpp: the sparse MoE block on the CPU (architecture.md §6).
//
// Math    P = softmax(m · W_routerᵀ) over E experts (fp32); top-k experts by P; ŵ = P / Σ_topk P (norm_topk_prob);
//         y_e = W_down[e] · (silu(W_gate[e] · m) ⊙ (W_up[e] · m));  s = W_sd · (silu(W_sg · m) ⊙ (W_su · m));
//         out = Σ_topk ŵ_e · y_e + σ(m · w_seg) · s.
// Mapping tokens split across threads when there are enough of them, otherwise each matrix's rows are.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/parallel.h"

namespace lily::cpu {

static void swiglu_mlp(const QMatrix& gate, const QMatrix& up, const QMatrix& down, const float* m, float* y,
                       bool par) {
  std::vector<float> g(gate.N), u(up.N);
  qmv(gate, m, g.data(), par);
  qmv(up, m, u.data(), par);
  for (int i = 0; i < gate.N; ++i) g[i] = silu(g[i]) * u[i];
  qmv(down, g.data(), y, par);
}

static void moe_token(const MoeArgs& a, const MoeWeights& w, const float* m, float* out, bool par) {
  std::vector<float> p(a.E), y(a.H), s(a.H);
  qmv(w.router, m, p.data(), par);
  const float mx = *std::max_element(p.begin(), p.end());
  float sum = 0.0f;
  for (float& v : p) sum += (v = std::exp(v - mx));
  for (float& v : p) v /= sum;

  std::vector<int> idx(a.E);
  std::iota(idx.begin(), idx.end(), 0);
  std::partial_sort(idx.begin(), idx.begin() + a.top_k, idx.end(),
                    [&](int i, int j) { return p[i] > p[j] || (p[i] == p[j] && i < j); });
  float norm = 1.0f;
  if (a.norm_topk_prob) {
    norm = 0.0f;
    for (int k = 0; k < a.top_k; ++k) norm += p[idx[k]];
  }
  std::fill(out, out + a.H, 0.0f);
  for (int k = 0; k < a.top_k; ++k) {
    const int e = idx[k];
    swiglu_mlp(w.gate.expert(e), w.up.expert(e), w.down.expert(e), m, y.data(), par);
    const float we = p[e] / norm;
    for (int i = 0; i < a.H; ++i) out[i] += we * y[i];
  }
  swiglu_mlp(w.shared_gate, w.shared_up, w.shared_down, m, s.data(), par);
  float gamma;
  qmv(w.shared_expert_gate, m, &gamma, false);
  gamma = sigmoid(gamma);
  for (int i = 0; i < a.H; ++i) out[i] += gamma * s[i];
}

void moe(const MoeArgs& a, const MoeWeights& w, const float* m, float* out) {
  if (a.T >= 2 * num_threads()) {
    parallel_for(a.T, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) moe_token(a, w, m + size_t(t) * a.H, out + size_t(t) * a.H, false);
    });
  } else {
    for (int t = 0; t < a.T; ++t) moe_token(a, w, m + size_t(t) * a.H, out + size_t(t) * a.H, true);
  }
}

}  // namespace lily::cpu
