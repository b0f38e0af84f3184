// checks.h: the argument checks the GPU backends' launchers share: what an op's arguments must satisfy whatever
// kernel runs it (weights present and of the shape the op needs, head layout, cache bounds). Each launcher then
// checks the limits of its own kernels (group multiples, index widths, alignment of its outputs). The CPU reference
// takes any shape these describe and checks nothing more.
#pragma once
#include <array>
#include <cstdint>

#include "backend/backend.h"

namespace lily {

// A weight the GPU kernels read: codes, scales and biases present, 4 or 8 bits, group 32, 64 or 128 dividing K,
// N ≥ 1, E ≥ 1, codes 16-byte aligned. `op` and `what` name it in the error ("qmm: W has bits=3 ...").
void check_qmatrix(const QMatrix& W, const char* op, const char* what);

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

// The router [E, H], the experts gate/up [E, I, H] and down [E, H, I], the shared expert [IS, H], [IS, H], [H, IS]
// and its gate [1, H], each checked to be present, of that shape and 4 or 8 bits ("moe: down is [...]").
std::array<MoeMatrix, 8> check_moe_matrices(const MoeArgs& a, const MoeWeights& w);

}  // namespace lily
