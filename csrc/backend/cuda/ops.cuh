// ops.cuh: the CUDA ops, one launcher per Backend method (backend.h gives their math and layouts) plus the GEMM
// building blocks the MoE op shares. Activations are bf16; fp32 where backend.h says so. Every launcher enqueues
// on ctx.stream, never synchronises, never allocates except through ctx.scratch, and ends with check_launch.
#pragma once
#include "backend/cuda/common.cuh"

namespace lily::cuda {

// norm.cu
void embed(Ctx& ctx, const QMatrix& table, const int32_t* tokens, int T, float* x);
void rms_norm(Ctx& ctx, const float* x, const float* w, int T, int H, float eps, bf16* out);
void add_rms_norm(Ctx& ctx, float* x, const bf16* d, const float* w, int T, int H, float eps, bf16* out);

// qmv.cu: y[T, N] = x[T, K] · Wᵀ streaming W once, for the T that qmv_takes: T ≤ kQmvMaxT (decode: fp32 GEMV) and
// T ≤ kQmvShortMaxT under the switch qmv_mma (a short prompt tail such as the 14-token assistant header after a
// server's opening-turn snapshot: tensor-core GEMV). qmv_multi does the same for n ≤ 4 matrices of equal K, bits and
// group size that read the same x, in one launch.
void qmv(Ctx& ctx, const QMatrix& W, const bf16* x, int T, void* y, bool y_f32);
void qmv_multi(Ctx& ctx, const QMatrix* Ws, int n, const bf16* x, int T, void* const* ys, bool y_f32);
bool qmv_takes(const Ctx& ctx, const QMatrix& W, int T);

// Switch norm_fold: what the kernel that updated one token's residual row x (fp32 [H]) left for the norm with weight
// w: the partial sums of x² over blocks of its elements (parts[n]) and xw = x ⊙ w (bf16 [H]). With them a GEMV
// applies rms_norm(x)·w without a norm kernel: rms_norm(x)·w · Wᵀ = r · (xw · Wᵀ), r = 1 / sqrt(Σ parts / H + eps)
// one scalar. n = 0: none left.
struct NormParts {
  const float* x = nullptr;
  const float* parts = nullptr;
  int n = 0;
  const float* w = nullptr;
  const bf16* xw = nullptr;
};
// Partial sums a producer may leave (its blocks): the launchers' buffers hold this many.
constexpr int kNormMaxParts = 512;
// qmv.cu, switch norm_fold (T = 1): y_i = (rms_norm(x.x)·x.w) · W_iᵀ on the streaming GEMV, the norm folded in; m, if
// set, also gets rms_norm(x.x)·x.w (bf16 [K]). False (nothing launched) where the streaming kernel does not take W.
bool qmv_fold(Ctx& ctx, const QMatrix* Ws, int n, const NormParts& x, float eps, void* const* ys, bool y_f32, bf16* m);
// qmv.cu (T = 1): x += y · Wᵀ (x fp32 [W.N]), xw = x ⊙ w (bf16), each block's Σx² over its rows into ss; the parts,
// or none (nothing launched) where the GEMV would take more than kNormMaxParts blocks.
NormParts qmv_residual(Ctx& ctx, const QMatrix& W, const bf16* y, float* x, const float* w, bf16* xw, float* ss);
// qmm.cu: any T; what qmv_takes goes to qmv, larger T to the tile GEMMs (N/256 blocks of 64 tokens at the least:
// latency-bound for a short tail, 32 µs for the 8 MB of an 8192 × 2048 projection at T = 14 on the H200).
void qmm(Ctx& ctx, const QMatrix& W, const bf16* x, int T, void* y, bool y_f32);
// qmm.cu: grouped GEMM over the experts of a stack (MoE prefill). Routed rows are sorted by expert: expert e owns
// rows r ∈ [offsets[e], offsets[e+1]) (device int32 [E+1]); row r reads x[rows[r]] (rows == null: x[r]).
//   B == null:  y[r, n] = x[rows[r]] · A_e[n]                                         n < A.N
//   B != null:  y[r, n] = silu(x[rows[r]] · A_e[n]) · (x[rows[r]] · B_e[n])          (gate, up: SwiGLU fused)
// max_rows is a host-side upper bound of offsets[E] that sizes the grid; tiles past offsets[E] exit at once, so
// no host synchronisation is needed; expert_rows is a host-side upper bound of any one expert's rows (T: a token's
// top-k experts are distinct), which lets a short tail run on small tiles only. y is [max_rows, A.N] bf16.
void moe_gemm(Ctx& ctx, const QMatrix& A, const QMatrix* B, const int32_t* offsets, const int32_t* rows,
              int max_rows, int expert_rows, const bf16* x, bf16* y);

// attention.cu (reads a.pos_dev when set)
void attention(Ctx& ctx, const AttnArgs& a, const bf16* qg, const bf16* k, const bf16* v, const float* q_norm,
               const float* k_norm, bf16* k_cache, bf16* v_cache, bf16* out);

// gdn.cu
void gdn_conv(Ctx& ctx, const GdnArgs& a, const bf16* x, const float* w, bf16* conv_state, bf16* out);
void gdn_scan(Ctx& ctx, const GdnArgs& a, const bf16* c, const bf16* b, const bf16* alpha, const float* A_log,
              const float* dt_bias, float* state, bf16* y);
// A decode token's conv, scan and gated norm (switches gdn_prep_fused and gdn_norm_fused, DV ≤ 128: the conv kernel,
// then the scan and the norm in one kernel); false (nothing launched) where it does not apply, and the caller runs
// gdn_conv, gdn_scan and gdn_norm. conv_out is the conv's output.
bool gdn_conv_scan_norm(Ctx& ctx, const GdnArgs& a, const bf16* x, const float* conv_w, bf16* conv_state,
                        bf16* conv_out, const bf16* b, const bf16* alpha, const float* A_log, const float* dt_bias,
                        float* state, const bf16* z, const float* w, bf16* out);
void gdn_norm(Ctx& ctx, const GdnArgs& a, const bf16* y, const bf16* z, const float* w, bf16* out);

// moe.cu
void moe(Ctx& ctx, const MoeArgs& a, const MoeWeights& w, const bf16* m, bf16* out);
// Backend::moe_residual: x += y·W_oᵀ; m = rms_norm(x)·nw; x += moe(m), the MoE result added in fp32 by the last kernel
// (down or combine) instead of going through a bf16 buffer and another add. Switch norm_fold, one token: the
// projection's GEMV adds into x and leaves its NormParts for nw (qmv_residual), and the router folds the norm in
// (qmv_fold, writing m): no norm kernel.
void moe_residual(Ctx& ctx, float* x, const QMatrix& W_o, const bf16* y, const float* nw, float eps, const MoeArgs& a,
                  const MoeWeights& w, bf16* m, bf16* out);

// sample.cu: token selection on the device (the rules of core/sample.h), for the parameters that
// backend/policy.h: device_can_sample accepts (the candidate set after top-k fits kSampleMaxCand entries).
void sample(Ctx& ctx, const SamplingParams& p, int n_valid, const float* logits, const DeviceSampler& st);

}  // namespace lily::cuda
