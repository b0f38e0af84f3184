// ops.h: the Metal launchers, one per Backend op (backend.h gives the math and layouts; the CUDA launchers in
// ../cuda/ops.cuh are the model to mirror: same op names, same tiling ideas expressed with simdgroups). Each
// launcher checks its preconditions with LILY_CHECK, binds the args struct and the buffers, and dispatches through
// the Encoder; it never allocates except via enc.scratch and never waits. Activations are bf16 (`uint16_t` bits
// on the host side, `bfloat` in MSL); fp32 where backend.h says so.
#pragma once
#include "backend/backend.h"
#include "backend/metal/encoder.h"
#include "backend/scratch.h"

namespace lily::metal {

// Scratch slots and the layouts of the buffers several kernels share: backend/scratch.h (the same for CUDA).
// A launcher that has an ablation switch (core/optimisations.h) takes the backend's Optimisations; off means the plain
// path.

// Largest T handled by the GEMV kernels; above it the simdgroup-matrix GEMM.
constexpr int kQmvMaxT = 8;

// norm.cpp (metal/norm.metal)
void embed(Encoder& enc, const QMatrix& table, const int32_t* tokens, int T, float* x);
void rms_norm(Encoder& enc, const float* x, const float* w, int T, int H, float eps, uint16_t* out);
void add_rms_norm(Encoder& enc, float* x, const uint16_t* d, const float* w, int T, int H, float eps, uint16_t* out);

// qmm.cpp (metal/qmv.metal, metal/qmm.metal)
void qmm(Encoder& enc, const QMatrix& W, const uint16_t* x, int T, void* y, bool y_f32);
void qmm_multi(Encoder& enc, const QMatrix* W, int n, const uint16_t* x, int T, uint16_t* const* y);
// Switch norm_fold (one token), as cuda::qmv_residual and cuda::qmv_fold (ops.cuh). qmv_residual: x += y · Wᵀ
// (x fp32 [W.N]), xw = x ⊙ w (bf16), each threadgroup's Σx² into parts, qmv_residual_parts(W) of them. qmv_fold:
// y = (rms_norm(xf)·nw) · Wᵀ from xw = xf ⊙ nw and the nparts partial sums; m gets rms_norm(xf)·nw (bf16 [K]).
void qmv_residual(Encoder& enc, const QMatrix& W, const uint16_t* y, float* x, const float* w, uint16_t* xw,
                  float* parts);
int qmv_residual_parts(const QMatrix& W);
void qmv_fold(Encoder& enc, const QMatrix& W, const uint16_t* xw, const float* parts, int nparts, float eps,
              const float* xf, const float* nw, void* y, bool y_f32, uint16_t* m);
// Grouped expert GEMM (MoE prefill), same contract as cuda::moe_gemm (ops.cuh).
void moe_gemm(Encoder& enc, const QMatrix& A, const QMatrix* B, const int32_t* offsets, const int32_t* rows,
              int max_rows, const uint16_t* x, uint16_t* y);

// attention.cpp (metal/attention.metal); reads a.pos_dev when set
void attention(Encoder& enc, const Optimisations& opts, const AttnArgs& a, const uint16_t* qg, const uint16_t* k,
               const uint16_t* v, const float* q_norm, const float* k_norm, uint16_t* k_cache, uint16_t* v_cache,
               uint16_t* out);

// gdn.cpp (metal/gdn.metal)
void gdn_conv(Encoder& enc, const GdnArgs& a, const uint16_t* x, const float* w, uint16_t* conv_state, uint16_t* out);
// gdn_scan: the chunked prefill when backend/policy.h's gdn_chunked says so (switch gdn_chunked), else token by token.
void gdn_scan(Encoder& enc, const Optimisations& opts, const GdnArgs& a, const uint16_t* c, const uint16_t* b,
              const uint16_t* alpha, const float* A_log, const float* dt_bias, float* state, uint16_t* y);
void gdn_norm(Encoder& enc, const GdnArgs& a, const uint16_t* y, const uint16_t* z, const float* w, uint16_t* out);
// gdn_conv_scan_norm: a decode token's conv, scan and gated norm in one dispatch (or the conv, then the scan with the
// norm) where backend/policy.h's gdn_token_path says so; false (nothing run) where the three ops run apart.
bool gdn_conv_scan_norm(Encoder& enc, const Optimisations& opts, const GdnArgs& a, const uint16_t* x,
                        const float* conv_w, uint16_t* conv_state, uint16_t* conv_out, const uint16_t* b,
                        const uint16_t* alpha, const float* A_log, const float* dt_bias, float* state,
                        const uint16_t* z, const float* w, uint16_t* out);

// moe.cpp (metal/moe.metal); the prefill sort is one threadgroup with the switch moe_sort_scan on
void moe(Encoder& enc, const Optimisations& opts, const MoeArgs& a, const MoeWeights& w, const uint16_t* m,
         uint16_t* out);
// Backend::moe_residual. Switch norm_fold, one token: the output projection's GEMV adds into x (qmv_residual) and the
// router folds the post-mixer norm in (qmv_fold, writing m), instead of the projection, add_rms_norm and the router.
void moe_residual(Encoder& enc, const Optimisations& opts, float* x, const QMatrix& W_o, const uint16_t* y,
                  const float* nw, float eps, const MoeArgs& a, const MoeWeights& w, uint16_t* m, uint16_t* out);

// sample.cpp (metal/sample.metal): core/sample.h's rules on the device, as cuda::sample, for the parameters that
// backend/policy.h: device_can_sample accepts; in two dispatches with the switch sample_split, else one threadgroup.
void sample(Encoder& enc, const Optimisations& opts, const SamplingParams& p, int n_valid, const float* logits,
            const DeviceSampler& st);

}  // namespace lily::metal
