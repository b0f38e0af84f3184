// common.h: what every Lily .metal file shares. Plain MSL that the CPU harness (tests/metal/harness) also compiles:
// bf16 travels as its 16-bit pattern (`ushort`), converted exactly here, so no kernel depends on `bfloat` support.
#pragma once
#include <metal_stdlib>
using namespace metal;

// bf16 bits → float (exact).
inline float bf16_to_float(ushort b) { return as_type<float>(uint(b) << 16); }

// float → bf16 bits, round to nearest even; NaN stays a quiet NaN (the same rounding as the CPU and CUDA code).
inline ushort float_to_bf16(float f) {
  uint u = as_type<uint>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return ushort((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return ushort(u >> 16);
}

// Code j (LSB first) of a packed word of BITS-bit codes, as a float (architecture.md §9.3).
template <int BITS>
inline float code(uint word, int j) {
  return float((word >> (BITS * j)) & ((1u << BITS) - 1u));
}

inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp(-x)); }
inline float silu_f(float x) { return x / (1.0f + exp(-x)); }
