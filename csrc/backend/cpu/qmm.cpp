// qmm.cpp: quantized matrix products and the embedding lookup on the CPU (architecture.md §3.2, §7, §9.3).
//
// Math    W[n, k] = scales[n, k/group] · q[n, k] + biases[n, k/group]; q is a `bits`-wide unsigned code
//         stored LSB-first: element k of a row is word k/(32/bits), bit offset bits·(k mod (32/bits)).
//         y[t, n] = Σ_k x[t, k] · W[n, k], accumulated in fp32 over k in order.
// Mapping W is walked in tiles of kLanes (16) rows. A tile is dequantised once per call into fp32, k-major
//         (wt[k, r]), group by group so that its lines stay in L1, and every token is multiplied into it by gemm
//         (4 tokens × 16 rows per step, the rows are the vector lanes). Tiles are split across threads. Scales may
//         be negative: nothing here assumes s > 0.
// Work    2·T·N·K FLOP + N·K dequantised weights (a real prefill chunk, T = 512: 512 multiply-adds per weight).
// History v1 one dequantised row at a time, a scalar dot product per token (one dependent chain of fp32 adds; the
//         dequantisation divided by the runtime bit width per element) · v2 16-row k-major tiles × 4-token gemm
//         (current; 25–29 GFLOP/s per core at T = 512, [2048 × 4096]).
#include <algorithm>
#include <vector>

#include "backend/cpu/ops.h"
#include "core/common.h"
#include "core/parallel.h"

namespace lily::cpu {
namespace {

// Groups g0 .. g1-1 of row n of W: element k of that range goes to out[k · stride].
template <int kBits>
void dequant_groups(const QMatrix& W, int n, size_t g0, size_t g1, float* out, size_t stride) {
  constexpr int kPerWord = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const int words_per_group = W.group / kPerWord;
  const uint32_t* w = W.w + size_t(n) * W.words_per_row() + g0 * words_per_group;
  const uint16_t* s = W.scales + size_t(n) * W.groups_per_row();
  const uint16_t* b = W.biases + size_t(n) * W.groups_per_row();
  size_t k = 0;
  for (size_t g = g0; g < g1; ++g) {
    const float sg = bf16_to_f32(s[g]), bg = bf16_to_f32(b[g]);
    for (int i = 0; i < words_per_group; ++i) {
      uint32_t word = *w++;
      for (int p = 0; p < kPerWord; ++p, ++k, word >>= kBits) out[k * stride] = sg * float(word & kMask) + bg;
    }
  }
}

void dequant_groups(const QMatrix& W, int n, size_t g0, size_t g1, float* out, size_t stride) {
  LILY_ASSERT(W.bits == 4 || W.bits == 8, "quantized matrix with ", W.bits, " bits reached the CPU backend");
  if (W.bits == 4)
    dequant_groups<4>(W, n, g0, g1, out, stride);
  else
    dequant_groups<8>(W, n, g0, g1, out, stride);
}

}  // namespace

void dequant_row(const QMatrix& W, int n, float* out) { dequant_groups(W, n, 0, W.groups_per_row(), out, 1); }

void qmm(const QMatrix& W, const float* x, int T, float* y) {
  const int64_t tiles = ceil_div(W.N, kLanes);
  parallel_for(tiles, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> wt(size_t(W.K) * kLanes);  // the tile, k-major: wt[k · kLanes + r]
    for (int64_t i = i0; i < i1; ++i) {
      const int n0 = int(i) * kLanes, rows = std::min(kLanes, W.N - n0);
      for (size_t g = 0; g < W.groups_per_row(); ++g) {  // group by group: the tile's lines stay in L1 meanwhile
        float* wg = wt.data() + g * W.group * kLanes;
        for (int r = 0; r < rows; ++r) dequant_groups(W, n0 + r, g, g + 1, wg + r, kLanes);
        for (int r = rows; r < kLanes; ++r)
          for (int k = 0; k < W.group; ++k) wg[size_t(k) * kLanes + r] = 0.0f;
      }
      gemm(x, W.K, 1, T, wt.data(), kLanes, W.K, y + n0, W.N, rows);
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
