// qmm.cpp: the launchers of metal/qmv.metal (GEMV, T ≤ kQmvMaxT, one to four matrices sharing x) and metal/qmm.metal
// (simdgroup-matrix GEMM for larger T, grouped expert GEMM of MoE prefill). The headers of the .metal files give the
// math, mapping and costs. Each launcher checks its preconditions, binds the args struct and the buffers in the
// kernel's parameter order, and dispatches; nothing waits for the device.
#include <algorithm>
#include <cstdint>
#include <initializer_list>

#include "../../../metal/qmm_args.h"
#include "backend/checks.h"
#include "backend/metal/ops.h"
#include "core/common.h"

namespace lily::metal {

namespace {

static_assert(kQmvMaxSegs == kQmvMaxMatrices, "metal/qmm_args.h and backend/checks.h disagree on qmm_multi");

int log2_exact(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

// What every kernel of this file needs from a weight: 16-byte code loads and 16-code runs that never straddle a
// group (backend/checks.h: check_qmatrix), indices that fit in 32 bits.
void check_weight(const QMatrix& W, const char* op, const char* what) {
  check_qmatrix(W, op, what);
  LILY_CHECK(int64_t(W.E) * W.N * int64_t(W.words_per_row()) < (int64_t(1) << 31), op, ": ", what, " (E=", W.E,
             ", N=", W.N, ", K=", W.K, ") has too many code words for 32-bit indexing");
}

// ---- GEMV: qmv_q{bits}_t{T} ------------------------------------------------------------------------------------

constexpr const char* kQmvNames[2][kQmvMaxT] = {
    {"qmv_q4_t1", "qmv_q4_t2", "qmv_q4_t3", "qmv_q4_t4", "qmv_q4_t5", "qmv_q4_t6", "qmv_q4_t7", "qmv_q4_t8"},
    {"qmv_q8_t1", "qmv_q8_t2", "qmv_q8_t3", "qmv_q8_t4", "qmv_q8_t5", "qmv_q8_t6", "qmv_q8_t7", "qmv_q8_t8"},
};

// The args of n (1..kQmvMaxSegs) matrices of equal K, bits and group size reading the same x; the threadgroups.
QmvArgs qmv_args(const QMatrix* Ws, int n, int T, bool y_f32, int64_t& groups) {
  const QMatrix& W = Ws[0];
  QmvArgs a{};
  a.K = W.K;
  a.chunks = W.K * W.bits / 128;
  a.groups = W.K / W.group;
  a.gshift = log2_exact(W.group * W.bits / 128);  // chunks per group
  a.KS = std::min(W.K, std::max(32, kQmvXFloats / T / 32 * 32));
  a.nseg = n;
  a.y_f32 = y_f32 ? 1 : 0;
  groups = 0;
  for (int i = 0; i < kQmvMaxSegs; ++i) {
    a.N[i] = i < n ? Ws[i].N : 0;
    a.tg0[i] = int(groups);
    if (i < n) groups += ceil_div(Ws[i].N, kQmvRowsPerGroup);
  }
  return a;
}

// n (1..kQmvMaxSegs) matrices of equal K, bits and group size reading the same x.
void qmv(Encoder& enc, const QMatrix* Ws, int n, const uint16_t* x, int T, void* const* ys, bool y_f32) {
  check_qmv(Ws, n, x, T, kQmvMaxT, ys);  // backend/checks.h; then these kernels' index width
  for (int i = 0; i < n; ++i) check_weight(Ws[i], "qmm", "W");
  const QMatrix& W = Ws[0];
  int64_t groups = 0;
  const QmvArgs a = qmv_args(Ws, n, T, y_f32, groups);
  enc.kernel(kQmvNames[W.bits == 8][T - 1]);
  enc.set_args(a);
  enc.set_buffer(1, x);  // x
  for (int i = 0; i < kQmvMaxSegs; ++i) {
    const int s = i < n ? i : 0;  // unused slots repeat matrix 0; the kernel never reads them
    enc.set_buffer(2 + 4 * i, Ws[s].w);       // w_i
    enc.set_buffer(3 + 4 * i, Ws[s].scales);  // s_i
    enc.set_buffer(4 + 4 * i, Ws[s].biases);  // b_i
    enc.set_buffer(5 + 4 * i, ys[s]);         // y_i
  }
  enc.set_threadgroup_memory(0, size_t(T) * a.KS * sizeof(float));  // xs
  enc.dispatch({uint32_t(groups), 1, 1}, {kQmvThreads, 1, 1});
}

// ---- GEMM: qmm_q{bits}_m{BM}, moe_gemm[_swiglu]_q{bits}_m{BM} ------------------------------------------------------

QmmArgs gemm_args(const QMatrix& W, int rows) {
  QmmArgs a{};
  a.K = W.K;
  a.N = W.N;
  a.rows = rows;
  a.groups = W.K / W.group;
  a.gshift = log2_exact(W.group);
  a.E = W.E;
  return a;
}

}  // namespace

void qmm(Encoder& enc, const QMatrix& W, const uint16_t* x, int T, void* y, bool y_f32) {
  if (T <= kQmvMaxT) {
    qmv(enc, &W, 1, x, T, &y, y_f32);
    return;
  }
  check_qmm(W, x, y);
  check_weight(W, "qmm", "W");
  LILY_CHECK(int64_t(T) * std::max(W.N, W.K) < (int64_t(1) << 31), "qmm: T=", T, " with N=", W.N, ", K=", W.K,
             " is too large for 32-bit indexing");

  // 16-row tiles up to T = 16 (a 32-row tile would be at least half empty), else 32-row tiles.
  const int bm = T > 16 ? 32 : 16;
  static constexpr const char* kNames[2][2] = {{"qmm_q4_m16", "qmm_q4_m32"}, {"qmm_q8_m16", "qmm_q8_m32"}};
  enc.kernel(kNames[W.bits == 8][bm == 32]);
  QmmArgs a = gemm_args(W, T);
  a.y_f32 = y_f32 ? 1 : 0;
  enc.set_args(a);
  enc.set_buffer(1, x);         // x
  enc.set_buffer(2, W.w);       // w
  enc.set_buffer(3, W.scales);  // scales
  enc.set_buffer(4, W.biases);  // biases
  enc.set_buffer(5, y);         // y
  enc.dispatch({uint32_t(ceil_div(W.N, kQmmBN)), uint32_t(ceil_div(T, bm)), 1}, {kQmmThreads, 1, 1});
}

namespace {

// A one-token GEMV of one matrix with its own epilogue (qmv_resid_*, qmv_fold_*): the args, x at 1, the matrix at
// 2..4, then the kernel's other buffers from 5 in its parameter order.
void dispatch_one(Encoder& enc, const char* kernel, const QmvArgs& a, int64_t groups, const void* x, const QMatrix& W,
                  std::initializer_list<const void*> more) {
  enc.kernel(kernel);
  enc.set_args(a);
  enc.set_buffer(1, x);
  enc.set_buffer(2, W.w);
  enc.set_buffer(3, W.scales);
  enc.set_buffer(4, W.biases);
  int i = 5;
  for (const void* p : more) enc.set_buffer(i++, p);
  enc.set_threadgroup_memory(0, size_t(a.KS) * sizeof(float));  // xs
  enc.dispatch({uint32_t(groups), 1, 1}, {kQmvThreads, 1, 1});
}

}  // namespace

void qmv_residual(Encoder& enc, const QMatrix& W, const uint16_t* y, float* x, const float* w, uint16_t* xw,
                  float* parts) {
  void* const xv = x;
  check_qmv(&W, 1, y, 1, kQmvMaxT, &xv);
  check_weight(W, "qmm", "W");
  int64_t groups = 0;
  const QmvArgs a = qmv_args(&W, 1, 1, false, groups);
  dispatch_one(enc, W.bits == 8 ? "qmv_resid_q8" : "qmv_resid_q4", a, groups, y, W, {x, w, xw, parts});
}

int qmv_residual_parts(const QMatrix& W) { return int(ceil_div(W.N, kQmvRowsPerGroup)); }

void qmv_fold(Encoder& enc, const QMatrix& W, const uint16_t* xw, const float* parts, int nparts, float eps,
              const float* xf, const float* nw, void* y, bool y_f32, uint16_t* m) {
  check_qmv(&W, 1, xw, 1, kQmvMaxT, &y);
  check_weight(W, "qmm", "W");
  int64_t groups = 0;
  QmvArgs a = qmv_args(&W, 1, 1, y_f32, groups);
  a.nparts = nparts;
  a.eps = eps;
  dispatch_one(enc, W.bits == 8 ? "qmv_fold_q8" : "qmv_fold_q4", a, groups, xw, W, {y, parts, xf, nw, m});
}

void qmm_multi(Encoder& enc, const QMatrix* W, int n, const uint16_t* x, int T, uint16_t* const* y) {
  LILY_CHECK(n >= 1 && n <= kQmvMaxMatrices, "qmm_multi: ", n, " matrices, 1 to ", kQmvMaxMatrices, " supported");
  if (T <= kQmvMaxT) {
    void* ys[kQmvMaxSegs] = {};
    for (int i = 0; i < n; ++i) ys[i] = y[i];
    qmv(enc, W, n, x, T, ys, false);
    return;
  }
  for (int i = 0; i < n; ++i) qmm(enc, W[i], x, T, y[i], false);
}

void moe_gemm(Encoder& enc, const QMatrix& A, const QMatrix* B, const int32_t* offsets, const int32_t* rows,
              int max_rows, const uint16_t* x, uint16_t* y) {
  check_moe_gemm(A, B, offsets, x, y, max_rows);
  check_weight(A, "moe_gemm", "A");  // B has A's shape
  LILY_CHECK(int64_t(max_rows) * std::max(A.N, A.K) < (int64_t(1) << 31), "moe_gemm: max_rows=", max_rows,
             " with N=", A.N, ", K=", A.K, " is too large for 32-bit indexing");
  if (max_rows == 0) return;

  // 32-row tiles when experts average at least 32 rows; below that the partial last tile of each expert wastes
  // too much, and 16-row tiles halve the waste.
  const int bm = int64_t(max_rows) >= int64_t(32) * A.E ? 32 : 16;
  static constexpr const char* kNames[2][2][2] = {
      {{"moe_gemm_q4_m16", "moe_gemm_q4_m32"}, {"moe_gemm_q8_m16", "moe_gemm_q8_m32"}},
      {{"moe_gemm_swiglu_q4_m16", "moe_gemm_swiglu_q4_m32"}, {"moe_gemm_swiglu_q8_m16", "moe_gemm_swiglu_q8_m32"}},
  };
  enc.kernel(kNames[B != nullptr][A.bits == 8][bm == 32]);
  QmmArgs a = gemm_args(A, max_rows);
  a.gather = rows ? 1 : 0;
  const QMatrix& Bm = B ? *B : A;  // bound but unread without SwiGLU
  enc.set_args(a);
  enc.set_buffer(1, x);                        // x
  enc.set_buffer(2, offsets);                  // offsets
  enc.set_buffer(3, rows ? rows : offsets);    // rows (unread when !gather)
  enc.set_buffer(4, A.w);                      // a_w
  enc.set_buffer(5, A.scales);                 // a_s
  enc.set_buffer(6, A.biases);                 // a_b
  enc.set_buffer(7, Bm.w);                     // b_w
  enc.set_buffer(8, Bm.scales);                // b_s
  enc.set_buffer(9, Bm.biases);                // b_b
  enc.set_buffer(10, y);                       // y
  const int out_cols = B ? kQmmBN / 2 : kQmmBN;
  const int64_t tiles = ceil_div(max_rows, bm) + A.E;  // ≥ Σ_e ceil(count_e / bm)
  enc.dispatch({uint32_t(ceil_div(A.N, out_cols)), uint32_t(tiles), 1}, {kQmmThreads, 1, 1});
}

}  // namespace lily::metal
