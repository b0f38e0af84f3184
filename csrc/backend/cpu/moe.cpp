// moe.cpp: the sparse MoE block on the CPU (architecture.md §6).
//
// Math    P = softmax(m · W_routerᵀ) over E experts (fp32); top-k experts by P; ŵ = P / Σ_topk P (norm_topk_prob);
//         y_e = W_down[e] · (silu(W_gate[e] · m) ⊙ (W_up[e] · m));  s = W_sd · (silu(W_sg · m) ⊙ (W_su · m));
//         out = Σ_topk ŵ_e · y_e + σ(m · w_seg) · s, summed in top-k order, the shared expert last.
// Mapping tokens in blocks of up to kBlock. The router is one qmm over the block; the routed (token, slot) pairs are
//         grouped by expert, and each expert runs its SwiGLU as three small GEMMs over its own rows (each expert tile
//         dequantised once per block), experts split across threads. The shared expert is three qmm over the whole
//         block. Expert outputs land in per-slot rows and are combined per token in top-k order, so every token's
//         result is the same whatever the block it came in.
// History v1 token by token, each token's experts dequantised again (prefill cost what decode did) · v2 grouped by
//         expert, one small GEMM per expert per block (current; tiny model 67 → 3,286 tok/s at 512 tokens).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/parallel.h"

namespace lily::cpu {
namespace {

constexpr int kBlock = 512;  // tokens per pass: bounds the scratch (kBlock · top_k · H fp32 expert outputs)

// y [n, H] = W_down · (silu(W_gate · x) ⊙ (W_up · x)) for the n rows of x [n, H].
void swiglu(const QMatrix& gate, const QMatrix& up, const QMatrix& down, const float* x, int n, float* y) {
  std::vector<float> g(size_t(n) * gate.N), u(size_t(n) * up.N);
  qmm(gate, x, n, g.data());
  qmm(up, x, n, u.data());
  for (size_t i = 0; i < g.size(); ++i) g[i] = silu(g[i]) * u[i];
  qmm(down, g.data(), n, y);
}

void moe_block(const MoeArgs& a, const MoeWeights& w, const float* m, int T, float* out) {
  const int H = a.H, E = a.E, K = a.top_k;
  // 1. Routing: slot t·K + j holds token t's j-th expert and its weight ŵ.
  std::vector<float> p(size_t(T) * E);
  qmm(w.router, m, T, p.data());
  std::vector<int> expert(size_t(T) * K);
  std::vector<float> weight(size_t(T) * K);
  parallel_for(T, 16, [&](int64_t t0, int64_t t1) {
    std::vector<int> idx(E);
    for (int64_t t = t0; t < t1; ++t) {
      float* pt = p.data() + size_t(t) * E;
      const float mx = *std::max_element(pt, pt + E);
      float sum = 0.0f;
      for (int e = 0; e < E; ++e) sum += (pt[e] = std::exp(pt[e] - mx));
      for (int e = 0; e < E; ++e) pt[e] /= sum;
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + K, idx.end(),
                        [&](int i, int j) { return pt[i] > pt[j] || (pt[i] == pt[j] && i < j); });
      float norm = 1.0f;
      if (a.norm_topk_prob) {
        norm = 0.0f;
        for (int j = 0; j < K; ++j) norm += pt[idx[j]];
      }
      for (int j = 0; j < K; ++j) {
        expert[size_t(t) * K + j] = idx[j];
        weight[size_t(t) * K + j] = pt[idx[j]] / norm;
      }
    }
  });

  // 2. Group the slots by expert (a counting sort: slots of expert e are slots[start[e] .. start[e+1])).
  std::vector<int> start(E + 1, 0), slots(size_t(T) * K), active;
  for (int e : expert) ++start[e + 1];
  for (int e = 0; e < E; ++e) start[e + 1] += start[e];
  {
    std::vector<int> fill(start.begin(), start.end() - 1);
    for (int s = 0; s < T * K; ++s) slots[fill[expert[s]]++] = s;
  }
  for (int e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);

  // 3. Routed experts: gather each expert's rows, run its SwiGLU over them, put the outputs in their slots.
  std::vector<float> ys(size_t(T) * K * H);  // [T, K, H]
  parallel_for(int64_t(active.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> xe, ye;
    for (int64_t i = i0; i < i1; ++i) {
      const int e = active[i], n = start[e + 1] - start[e];
      const int* sl = slots.data() + start[e];
      xe.resize(size_t(n) * H);
      ye.resize(size_t(n) * H);
      for (int r = 0; r < n; ++r) std::copy_n(m + size_t(sl[r] / K) * H, H, xe.data() + size_t(r) * H);
      swiglu(w.gate.expert(e), w.up.expert(e), w.down.expert(e), xe.data(), n, ye.data());
      for (int r = 0; r < n; ++r) std::copy_n(ye.data() + size_t(r) * H, H, ys.data() + size_t(sl[r]) * H);
    }
  });

  // 4. The shared expert and its sigmoid gate, over every token.
  std::vector<float> s(size_t(T) * H), gamma(T);
  swiglu(w.shared_gate, w.shared_up, w.shared_down, m, T, s.data());
  qmm(w.shared_expert_gate, m, T, gamma.data());

  // 5. out = Σ_j ŵ_j · y_j in top-k order, then + σ(γ) · s.
  parallel_for(T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = out + size_t(t) * H;
      std::fill(o, o + H, 0.0f);
      for (int j = 0; j < K; ++j) {
        const float we = weight[size_t(t) * K + j];
        const float* y = ys.data() + (size_t(t) * K + j) * H;
        for (int i = 0; i < H; ++i) o[i] += we * y[i];
      }
      const float g = sigmoid(gamma[t]);
      const float* st = s.data() + size_t(t) * H;
      for (int i = 0; i < H; ++i) o[i] += g * st[i];
    }
  });
}

}  // namespace

void moe(const MoeArgs& a, const MoeWeights& w, const float* m, float* out) {
  for (int t0 = 0; t0 < a.T; t0 += kBlock)
    moe_block(a, w, m + size_t(t0) * a.H, std::min(kBlock, a.T - t0), out + size_t(t0) * a.H);
}

}  // namespace lily::cpu
