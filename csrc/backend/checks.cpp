// checks.cpp: see checks.h.
#include "backend/checks.h"

#include "core/common.h"

namespace lily {

void check_qmatrix(const QMatrix& W, const char* op, const char* what) {
  LILY_CHECK(W.w && W.scales && W.biases, op, ": ", what, " has a null codes/scales/biases pointer");
  LILY_CHECK(W.bits == 4 || W.bits == 8, op, ": ", what, " has bits=", W.bits, " (4 or 8 supported)");
  LILY_CHECK(W.group == 32 || W.group == 64 || W.group == 128, op, ": ", what, " has group=", W.group,
             " (32, 64 or 128 supported)");
  LILY_CHECK(W.N >= 1 && W.K >= W.group && W.K % W.group == 0, op, ": ", what, " has N=", W.N, ", K=", W.K,
             "; K must be a positive multiple of the group size ", W.group);
  LILY_CHECK(W.E >= 1, op, ": ", what, " has E=", W.E);
  LILY_CHECK(reinterpret_cast<uintptr_t>(W.w) % 16 == 0, op, ": ", what, " codes are not 16-byte aligned");
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
  LILY_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0, "moe_gemm: x is not 16-byte aligned");
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

std::array<MoeMatrix, 8> check_moe_matrices(const MoeArgs& a, const MoeWeights& w) {
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
