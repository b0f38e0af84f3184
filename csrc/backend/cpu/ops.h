// ops.h: the CPU reference ops. Plain loops, fp32 activations and accumulation, every line traceable to
// architecture.md; the section each op implements is named in its file. Blocked loops and threads
// (core/parallel.h) are the only concessions to speed: no intrinsics, no fast math. These ops define what every
// other backend must compute.
//
// Blocking. Prefill multiplies many tokens by the same weights, so the matrix ops work on blocks: a tile of 16
// weight rows is dequantised once per call and every token is multiplied into it (gemm below). The 16 rows are
// the vector lanes, so each output is still one fp32 sum over k in order, the same sum a plain dot product
// makes: blocking changes the speed, not the numbers (decode and prefill agree bit for bit).
#pragma once
#include <cmath>

#include "backend/backend.h"

// Fully unrolls a loop over the kLanes lanes, which lets GCC's -O2 vectoriser (and clang's) turn it into vector
// instructions on any target; it changes no arithmetic.
#define LILY_UNROLL_LANES _Pragma("GCC unroll 16")

namespace lily::cpu {

constexpr int kLanes = 16;  // columns of one gemm tile: weight rows (qmm), query rows (attention), state columns (GDN)

// y[i·ys + c] = Σ_{k<K} x[i·xi + k·xk] · w[k·ws + c]  for i < n, c < cols ≤ kLanes; each sum runs over k in order.
// w must hold kLanes readable floats at every k (columns from cols on are computed and dropped).
void gemm(const float* x, size_t xi, size_t xk, int n, const float* w, size_t ws, int K, float* y, size_t ys,
          int cols);

// Dequantizes row n of W (one matrix, E = 1) into out[K] (architecture.md §9.3).
void dequant_row(const QMatrix& W, int n, float* out);

void embed(const QMatrix& table, const int32_t* tokens, int T, float* x);
// y [T, N] = x [T, K] · Wᵀ; row tiles split across threads (nested calls run on the calling thread).
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
