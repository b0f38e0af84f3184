// gemm.cuh: decoding of MLX affine codes (architecture.md §9.3) shared by qmv.cu (GEMV) and qmm.cu (tensor-core
// GEMM). Private to those two files.
//
// A packed word holds 32/BITS codes, LSB first. Codes become floats with one byte permute each (no int→float
// conversion, which runs at quarter rate): the code's byte is placed under a fixed exponent, so the float's value
// is kOffset + q exactly.
//   4-bit: byte i of (w & 0x0F0F0F0F) holds code 2i, byte i of (w >> 4 & 0x0F0F0F0F) code 2i+1; placing the byte
//          in bits 16..23 under exponent byte 0x43 gives 2^7·(1 + q/2^7) = 128 + q. The offset is folded into the
//          group bias: s·q + b = s·(128 + q) + (b − 128·s).
//   8-bit: byte i in bits 0..7 under 0x4B gives 2^23 + q; subtracting 2^23 is exact, so kOffset = 0.
#pragma once
#include "backend/checks.h"
#include "backend/cuda/common.cuh"

namespace lily::cuda {

template <int BITS>
struct QCodes;

template <>
struct QCodes<4> {
  static constexpr int kPerWord = 8;
  static constexpr float kOffset = 128.0f;
  // v[j] = 128 + q_j for the 8 codes of w.
  __device__ __forceinline__ static void decode(uint32_t w, float* v) {
    const uint32_t lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t sel = 0x7044u | (uint32_t(i) << 8);  // bytes: 0, 0, code byte i, 0x43
      v[2 * i] = __uint_as_float(__byte_perm(lo, 0x43000000u, sel));
      v[2 * i + 1] = __uint_as_float(__byte_perm(hi, 0x43000000u, sel));
    }
  }
};

template <>
struct QCodes<8> {
  static constexpr int kPerWord = 4;
  static constexpr float kOffset = 0.0f;
  // v[j] = q_j for the 4 codes of w.
  __device__ __forceinline__ static void decode(uint32_t w, float* v) {
#pragma unroll
    for (int i = 0; i < 4; ++i)  // bytes: code byte i, 0, 0, 0x4B  →  2^23 + q
      v[i] = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | uint32_t(i))) - 8388608.0f;
  }
};

// log2 of a power of two (host).
inline int log2_exact(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

// The preconditions qmv and the GEMMs share (backend/checks.h: check_qmatrix) give one weight layout the kernels
// can read with 16-byte loads and whose 32-code runs never straddle a group.

}  // namespace lily::cuda
