// checks.cpp: see checks.h.
#include "backend/checks.h"

#include <algorithm>

#include "core/common.h"
#include "core/config.h"

namespace lily {

void check_embed(const QMatrix& table, int T, const float* x) {
  LILY_CHECK(table.E == 1, "embed: the table must be a single matrix, got a stack of ", table.E);
  LILY_CHECK(T >= 0, "embed: T = ", T, " is negative");
  LILY_CHECK(table.bits == 4 || table.bits == 8, "embed: ", table.bits, "-bit tables are not supported (4 or 8)");
  const int per_word = 32 / table.bits;
  LILY_CHECK(table.group > 0 && table.group % per_word == 0 && table.K % table.group == 0, "embed: group ",
             table.group, " must divide K = ", table.K, " and be a multiple of ", per_word);
  LILY_CHECK(aligned(x, 16), "embed: x must be 16-byte aligned");
}

void check_norm(const char* op, int T, int H, const float* x, const float* w, const void* d, const void* out) {
  LILY_CHECK(T >= 0, op, ": T = ", T, " is negative");
  LILY_CHECK(H > 0 && H % 4 == 0 && H <= kNormMaxH, op, ": H = ", H, " must be a positive multiple of 4 and at most ",
             kNormMaxH);
  LILY_CHECK(aligned(x, 16) && aligned(w, 16) && aligned(d, 8) && aligned(out, 8), op,
             ": x and w must be 16-byte aligned, d and out 8-byte aligned");
}

void check_gdn_heads(const GdnArgs& a, const char* op) {
  LILY_CHECK(a.T >= 0, op, ": T = ", a.T, " is negative");
  LILY_CHECK(a.NK > 0 && a.NV > 0 && a.NV % a.NK == 0, op, ": NV = ", a.NV, " must be a positive multiple of NK = ",
             a.NK);
  LILY_CHECK(a.DK > 0 && a.DV > 0, op, ": DK = ", a.DK, " and DV = ", a.DV, " must be positive");
}

void check_gdn_conv(const GdnArgs& a, const void* x, const void* conv_state, const void* out) {
  check_gdn_heads(a, "gdn_conv");
  const int C = 2 * a.NK * a.DK + a.NV * a.DV;
  LILY_CHECK(C % 4 == 0, "gdn_conv: conv_dim ", C, " must be a multiple of 4");
  LILY_CHECK(a.conv_kernel >= 1 && a.conv_kernel <= kMaxConvKernel, "gdn_conv: conv_kernel ", a.conv_kernel,
             " must be in [1, ", kMaxConvKernel, "]");
  LILY_CHECK(aligned(x, 8) && aligned(out, 8) && aligned(conv_state, 8),
             "gdn_conv: x, out and conv_state must be 8-byte aligned");
}

void check_qmatrix(const QMatrix& W, const char* op, const char* what) {
  LILY_CHECK(W.w && W.scales && W.biases, op, ": ", what, " has a null codes/scales/biases pointer");
  LILY_CHECK(W.bits == 4 || W.bits == 8, op, ": ", what, " has bits=", W.bits, " (4 or 8 supported)");
  LILY_CHECK(W.group == 32 || W.group == 64 || W.group == 128, op, ": ", what, " has group=", W.group,
             " (32, 64 or 128 supported)");
  LILY_CHECK(W.N >= 1 && W.K >= W.group && W.K % W.group == 0, op, ": ", what, " has N=", W.N, ", K=", W.K,
             "; K must be a positive multiple of the group size ", W.group);
  LILY_CHECK(W.E >= 1, op, ": ", what, " has E=", W.E);
  LILY_CHECK(aligned(W.w, 16), op, ": ", what, " codes are not 16-byte aligned");
}

void check_qmm(const QMatrix& W, const void* x, const void* y) {
  check_qmatrix(W, "qmm", "W");
  LILY_CHECK(W.E == 1, "qmm: W must be one matrix (E=", W.E, ")");
  LILY_CHECK(x && y, "qmm: null x or y");
  LILY_CHECK(aligned(x, 16), "qmm: x is not 16-byte aligned");
}

void check_qmv(const QMatrix* Ws, int n, const void* x, int T, int max_T, void* const* ys) {
  LILY_CHECK(n >= 1 && n <= kQmvMaxMatrices, "qmm_multi: ", n, " matrices, 1 to ", kQmvMaxMatrices, " supported");
  for (int i = 0; i < n; ++i) {
    check_qmatrix(Ws[i], "qmm", "W");
    LILY_CHECK(Ws[i].E == 1, "qmm: W must be one matrix (E=", Ws[i].E, ")");
    LILY_CHECK(Ws[i].K == Ws[0].K && Ws[i].bits == Ws[0].bits && Ws[i].group == Ws[0].group,
               "qmm_multi: matrices sharing x in one launch need the same K, bits and group size");
    LILY_CHECK(ys[i], "qmm: null y");
  }
  LILY_CHECK(T >= 1 && T <= max_T, "qmm: T=", T, " is outside [1, ", max_T, "] for the GEMV");
  LILY_CHECK(x && aligned(x, 16), "qmm: x is null or not 16-byte aligned");
}

void check_moe_gemm(const QMatrix& A, const QMatrix* B, const int32_t* offsets, const void* x, const void* y,
                    int max_rows) {
  check_qmatrix(A, "moe_gemm", "A");
  if (B) {
    check_qmatrix(*B, "moe_gemm", "B");
    LILY_CHECK(B->E == A.E && B->N == A.N && B->K == A.K && B->bits == A.bits && B->group == A.group,
               "moe_gemm: B (E=", B->E, ", N=", B->N, ", K=", B->K, ", bits=", B->bits, ", group=", B->group,
               ") does not match A (E=", A.E, ", N=", A.N, ", K=", A.K, ", bits=", A.bits, ", group=", A.group, ")");
  }
  LILY_CHECK(offsets && x && y, "moe_gemm: null offsets, x or y");
  LILY_CHECK(max_rows >= 0, "moe_gemm: max_rows=", max_rows);
  LILY_CHECK(aligned(x, 16), "moe_gemm: x is not 16-byte aligned");
}

void check_attention(const AttnArgs& a) {
  LILY_CHECK(a.T >= 1 && a.NH >= 1 && a.NKV >= 1 && a.NH % a.NKV == 0, "attention: bad heads NH=", a.NH,
             " NKV=", a.NKV, " (T=", a.T, ")");
  LILY_CHECK(a.HD == 32 || a.HD == 64 || a.HD == 128 || a.HD == 256, "attention: head dim ", a.HD,
             " is not one of 32, 64, 128, 256");
  LILY_CHECK(a.rotary_dim >= 0 && a.rotary_dim % 2 == 0 && a.rotary_dim <= a.HD, "attention: rotary_dim ",
             a.rotary_dim, " must be even and at most HD=", a.HD);
  LILY_CHECK(a.pos0 >= 0 && int64_t(a.pos0) + a.T <= a.cache_cap, "attention: rows ", a.pos0, "..",
             int64_t(a.pos0) + a.T, " exceed the KV cache capacity ", a.cache_cap);
}

std::array<MoeMatrix, 8> check_moe(const MoeArgs& a, const MoeWeights& w, const void* m, const void* out) {
  LILY_CHECK(a.T >= 0, "moe: T = ", a.T, " is negative");
  LILY_CHECK(a.E >= 1 && a.E <= kMoeMaxExperts, "moe: E = ", a.E, " must be in [1, ", kMoeMaxExperts, "]");
  LILY_CHECK(a.top_k >= 1 && a.top_k <= std::min(a.E, kMoeMaxTopK), "moe: top_k = ", a.top_k, " must be in [1, min(E, ",
             kMoeMaxTopK, ")]");
  LILY_CHECK(a.H > 0 && a.H % 8 == 0, "moe: H = ", a.H, " must be a positive multiple of 8");
  LILY_CHECK(a.I > 0 && a.IS > 0, "moe: I = ", a.I, " and IS = ", a.IS, " must be positive");
  LILY_CHECK(aligned(m, 16) && aligned(out, 16), "moe: m and out must be 16-byte aligned");
  const std::array<MoeMatrix, 8> all{{{w.router, "router", 1, a.E, a.H},
                                      {w.gate, "gate", a.E, a.I, a.H},
                                      {w.up, "up", a.E, a.I, a.H},
                                      {w.down, "down", a.E, a.H, a.I},
                                      {w.shared_gate, "shared_gate", 1, a.IS, a.H},
                                      {w.shared_up, "shared_up", 1, a.IS, a.H},
                                      {w.shared_down, "shared_down", 1, a.H, a.IS},
                                      {w.shared_expert_gate, "shared_expert_gate", 1, 1, a.H}}};
  for (const MoeMatrix& m : all) {
    const QMatrix& q = m.q;
    LILY_CHECK(q.w && q.scales && q.biases, "moe: ", m.name, " has a null codes/scales/biases pointer");
    LILY_CHECK(q.E == m.E && q.N == m.N && q.K == m.K, "moe: ", m.name, " is [", q.E, ", ", q.N, ", ", q.K,
               "], expected [", m.E, ", ", m.N, ", ", m.K, "]");
    LILY_CHECK(q.bits == 4 || q.bits == 8, "moe: ", m.name, " has bits=", q.bits, " (4 or 8 supported)");
  }
  return all;
}

}  // namespace lily
