// checks.h: the argument checks the GPU backends' launchers share: what an op's arguments must satisfy whatever
// kernel runs it (weights present and of the shape the op needs, head layout, cache bounds, the limits both backends'
// kernels have). Each launcher then checks the limits of its own kernels (group multiples, index widths, alignment of
// its outputs). The CPU reference takes any shape these describe and checks nothing more.
#pragma once
#include <array>
#include <cstdint>

#include "backend/backend.h"

namespace lily {

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Largest row of the RMSNorm kernels: 1024 threads with 8 float4 chunks each.
constexpr int kNormMaxH = 32768;
// The MoE routing kernels: one warp / simdgroup per token holds the E ≤ kMoeMaxExperts probabilities (8 per lane) and
// one lane per routed slot (top_k ≤ kMoeMaxTopK).
constexpr int kMoeMaxExperts = 256;
constexpr int kMoeMaxTopK = 32;

// embed: one table (E = 1) of 4 or 8 bits whose group holds whole code words, T ≥ 0, x 16-byte aligned.
void check_embed(const QMatrix& table, int T, const float* x);

// rms_norm / add_rms_norm (`op` names it): T ≥ 0, H a positive multiple of 4 up to kNormMaxH, x and w 16-byte aligned,
// d (may be null) and out 8-byte aligned.
void check_norm(const char* op, int T, int H, const float* x, const float* w, const void* d, const void* out);

// The Gated DeltaNet ops (`op` names it): T ≥ 0, NV a positive multiple of NK, DK and DV positive.
void check_gdn_heads(const GdnArgs& a, const char* op);
// gdn_conv: the heads, conv_dim a multiple of 4, 1 ≤ conv_kernel ≤ kMaxConvKernel (core/config.h), x, conv_state and
// out 8-byte aligned.
void check_gdn_conv(const GdnArgs& a, const void* x, const void* conv_state, const void* out);

// A weight the GPU kernels read: codes, scales and biases present, 4 or 8 bits, group 32, 64 or 128 dividing K,
// N ≥ 1, E ≥ 1, codes 16-byte aligned. `op` and `what` name it in the error ("qmm: W has bits=3 ...").
void check_qmatrix(const QMatrix& W, const char* op, const char* what);

// qmm on the GEMM path: W valid and one matrix (E = 1), x and y present, x 16-byte aligned.
void check_qmm(const QMatrix& W, const void* x, const void* y);

// qmm / qmm_multi on the GEMV path (T ≤ max_T): 1 ≤ n ≤ kQmvMaxMatrices matrices, each valid, one matrix, of the first
// one's K, bits and group size (they share x), every y present; 1 ≤ T ≤ max_T; x present and 16-byte aligned.
constexpr int kQmvMaxMatrices = 4;
void check_qmv(const QMatrix* Ws, int n, const void* x, int T, int max_T, void* const* ys);

// The grouped expert GEMM: A valid, B (the fused SwiGLU's second matrix) of A's shape and format, offsets, x and y
// present, max_rows ≥ 0, x 16-byte aligned.
void check_moe_gemm(const QMatrix& A, const QMatrix* B, const int32_t* offsets, const void* x, const void* y,
                    int max_rows);

// Attention: T ≥ 1, NH a multiple of NKV, head dim 32, 64, 128 or 256, rotary_dim even and ≤ HD, the new KV rows
// pos0 .. pos0+T inside the cache.
void check_attention(const AttnArgs& a);

// One of the MoE block's eight matrices with the [E, N, K] the block needs it to have.
struct MoeMatrix {
  const QMatrix& q;
  const char* name;
  int E, N, K;
};

// The MoE block: T ≥ 0, 1 ≤ E ≤ kMoeMaxExperts, 1 ≤ top_k ≤ min(E, kMoeMaxTopK), H a positive multiple of 8, I and IS
// positive, m and out 16-byte aligned; and the router [E, H], the experts gate/up [E, I, H] and down [E, H, I], the
// shared expert [IS, H], [IS, H], [H, IS] and its gate [1, H], each present, of that shape and 4 or 8 bits
// ("moe: down is [...]"). Returns the eight matrices for the launcher's own checks.
std::array<MoeMatrix, 8> check_moe(const MoeArgs& a, const MoeWeights& w, const void* m, const void* out);

}  // namespace lily
