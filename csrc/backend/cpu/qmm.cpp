// qmm.cpp: quantized matrix products and the embedding lookup on the CPU (architecture.md §3.2, §7, §9.3).
//
// Math    W[n, k] = scales[n, k/group] · q[n, k] + biases[n, k/group]; q is a `bits`-wide unsigned code
//         stored LSB-first: element k of a row is word k/(32/bits), bit offset bits·(k mod (32/bits)).
//         y[t, n] = Σ_k x[t, k] · W[n, k], accumulated in fp32.
// Mapping one dequantized row at a time (K floats, cache resident), dotted with every token's x; rows are split
//         across threads. Scales may be negative: nothing here assumes s > 0.
#include <vector>

#include "backend/cpu/ops.h"
#include "core/common.h"
#include "core/parallel.h"

namespace lily::cpu {

void dequant_row(const QMatrix& W, int n, float* out) {
  const int per_word = 32 / W.bits;
  const uint32_t mask = (1u << W.bits) - 1u;
  const uint32_t* w = W.w + size_t(n) * W.words_per_row();
  const uint16_t* s = W.scales + size_t(n) * W.groups_per_row();
  const uint16_t* b = W.biases + size_t(n) * W.groups_per_row();
  for (int k = 0; k < W.K; ++k) {
    uint32_t q = (w[k / per_word] >> (W.bits * (k % per_word))) & mask;
    int g = k / W.group;
    out[k] = bf16_to_f32(s[g]) * float(q) + bf16_to_f32(b[g]);
  }
}

static float dot(const float* a, const float* b, int n) {
  float acc = 0.0f;
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

void qmv(const QMatrix& W, const float* x, float* y, bool parallel) {
  auto rows = [&](int64_t n0, int64_t n1) {
    std::vector<float> row(W.K);
    for (int64_t n = n0; n < n1; ++n) {
      dequant_row(W, int(n), row.data());
      y[n] = dot(row.data(), x, W.K);
    }
  };
  if (parallel)
    parallel_for(W.N, 16, rows);
  else
    rows(0, W.N);
}

void qmm(const QMatrix& W, const float* x, int T, float* y) {
  parallel_for(W.N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(W.K);
    for (int64_t n = n0; n < n1; ++n) {
      dequant_row(W, int(n), row.data());
      for (int t = 0; t < T; ++t) y[size_t(t) * W.N + n] = dot(row.data(), x + size_t(t) * W.K, W.K);
    }
  });
}

void embed(const QMatrix& table, const int32_t* tokens, int T, float* x) {
  for (int t = 0; t < T; ++t) {
    LILY_CHECK(tokens[t] >= 0 && tokens[t] < table.N, "token id ", tokens[t], " at position ", t,
               " is outside the vocabulary [0, ", table.N, ")");
    dequant_row(table, tokens[t], x + size_t(t) * table.K);
  }
}

}  // namespace lily::cpu
