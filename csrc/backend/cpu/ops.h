// ops.h: the CPU reference ops. Plain loops, fp32 activations and accumulation, every line traceable to
// architecture.md; the section each op implements is named in its file. Threads (core/parallel.h) are the only
// concession to speed. These ops define what every other backend must compute.
#pragma once
#include <cmath>

#include "backend/backend.h"

namespace lily::cpu {

// Dequantize row n of W (one matrix, E = 1) into out[K] (architecture.md §9.3).
void dequant_row(const QMatrix& W, int n, float* out);
// y[N] = W · x for one token; rows split across threads when `parallel`.
void qmv(const QMatrix& W, const float* x, float* y, bool parallel);

void embed(const QMatrix& table, const int32_t* tokens, int T, float* x);
void qmm(const QMatrix& W, const float* x, int T, float* y);
void rms_norm(const float* x, const float* w, int T, int H, float eps, float* out);
void add_rms_norm(float* x, const float* d, const float* w, int T, int H, float eps, float* out);
void attention(const AttnArgs& a, const float* qg, const float* k, const float* v, const float* q_norm,
               const float* k_norm, float* k_cache, float* v_cache, float* out);
void gdn_conv(const GdnArgs& a, const float* x, const float* w, float* conv_state, float* out);
void gdn_scan(const GdnArgs& a, const float* c, const float* b, const float* alpha, const float* A_log,
              const float* dt_bias, float* state, float* y);
void gdn_norm(const GdnArgs& a, const float* y, const float* z, const float* w, float* out);
void moe(const MoeArgs& a, const MoeWeights& w, const float* m, float* out);

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x * sigmoid(x); }

}  // namespace lily::cpu
