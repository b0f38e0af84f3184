// x16.cuh: x in 16-bit fixed point for integer dot products with 4- and 8-bit MLX codes (dp4a), shared by the decode
// GEMV (qmv.cu, switch qmv_dp4a) and the decode MoE (moe.cu, switch moe_dp4a).
//
// A 16-byte chunk of codes (32 at 4 bits, 16 at 8) meets its x values staged as integers x16 = x·2^(14−e), e the
// exponent of the chunk's largest |x|, so |x16| < 2^15: exact for every bf16 element within 2^7 of that largest, the
// rest rounded to a multiple of 2^(e−14) (off by ≤ 2^-15 of the chunk's largest). x16 = 256·hi + lo, hi a signed and
// lo an unsigned byte, four to a word in the order of the codes' bytes:
//   4 bits: a word w's even codes are the low nibbles of its bytes (w & 0x0F0F0F0F), its odd codes the high nibbles
//     times 16 (w & 0xF0F0F0F0, no shift), so w meets one uint4 {hi of x0 x2 x4 x6, hi of x1 x3 x5 x7, lo even, lo
//     odd}: four dp4a give A = Σ q_even·hi_even, B = 16·Σ q_odd·hi_odd, C, D the same with lo, and over a chunk
//     16·Σ q·x16 = 256·(16·A + B) + 16·C + D, exact in int32 (|·| < 2^28).
//   8 bits: a word's four codes meet {hi, lo} of the same four elements; Σ q·x16 = 256·A + C (|·| < 2^28).
// Then y += s·xd·Σ + b·Σx with xd = 2^(e−18) (4 bits) or 2^(e−14) (8 bits), Σx the exact fp32 sum of the chunk's x.
// Per 8 codes at 4 bits: 2 LOP3 + 4 IDP4A, against 2 LOP3 + 8 PRMT + 8 FFMA for the fp32 form.
// Layout: uint4 slots of chunk c at c·kX16Slots + (slot XOR a swizzle of c), so that the 8 lanes of a quarter-warp
// reading 8 consecutive chunks hit 8 distinct bank groups; then Σx fp32 [chunks] and xd fp32 [chunks].
#pragma once
#include "backend/cuda/common.cuh"

namespace lily::cuda {

template <int BITS>
constexpr int kX16Slots = BITS == 4 ? 4 : 2;  // uint4 slots of x16 per 16-byte code chunk

template <int BITS>
__device__ __forceinline__ int x16_slot(int c, int s) {
  return c * kX16Slots<BITS> + (BITS == 4 ? s ^ ((c >> 1) & 3) : s ^ ((c >> 2) & 1));
}

// The exponent e of a chunk whose largest |x| is m (clamped so that 2^(14−e) and 2^(e−18) stay normal floats).
__device__ __forceinline__ int x16_exp(float m) { return max(int((__float_as_uint(m) >> 23) & 0xFFu) - 127, -100); }
__device__ __forceinline__ float pow2f(int k) { return __uint_as_float(uint32_t(127 + k) << 23); }  // -126 ≤ k ≤ 127
// round(v) for |v| < 2^22, by the float's own rounding: the integer's low bits land in the significand.
__device__ __forceinline__ int round_small(float v) { return __float_as_int(v + 12582912.0f) - 0x4B400000; }

// hi and lo bytes of four x16 values as two words (byte j: value j).
__device__ __forceinline__ void x16_bytes(int a, int b, int c, int d, uint32_t& hi, uint32_t& lo) {
  const uint32_t ua = uint32_t(a), ub = uint32_t(b), uc = uint32_t(c), ud = uint32_t(d);
  hi = __byte_perm(__byte_perm(ua, ub, 0x0051), __byte_perm(uc, ud, 0x0051), 0x5410);  // bytes 1: hi
  lo = __byte_perm(__byte_perm(ua, ub, 0x0040), __byte_perm(uc, ud, 0x0040), 0x5410);  // bytes 0: lo
}

// Stages one chunk's kEpc values v (held by one thread): its x16 slots, Σx and xd.
template <int BITS>
__device__ __forceinline__ void put_x16_chunk(uint4* xi, float* xsum, float* xd, int c, const float* v) {
  constexpr int kEpc = 128 / BITS;
  float m = 0.0f, sum = 0.0f;
#pragma unroll
  for (int j = 0; j < kEpc; ++j) m = fmaxf(m, fabsf(v[j])), sum += v[j];
  const int e = x16_exp(m);
  const float mul = pow2f(14 - e);
  int x[kEpc];
#pragma unroll
  for (int j = 0; j < kEpc; ++j) x[j] = round_small(v[j] * mul);
#pragma unroll
  for (int s = 0; s < kX16Slots<BITS>; ++s) {
    uint4 o;
    if constexpr (BITS == 4) {  // slot s: word s of the chunk, 8 elements
      const int* w = x + 8 * s;
      x16_bytes(w[0], w[2], w[4], w[6], o.x, o.z);
      x16_bytes(w[1], w[3], w[5], w[7], o.y, o.w);
    } else {  // slot s: words 2s, 2s + 1, 4 elements each
      const int* w = x + 8 * s;
      x16_bytes(w[0], w[1], w[2], w[3], o.x, o.y);
      x16_bytes(w[4], w[5], w[6], w[7], o.z, o.w);
    }
    xi[x16_slot<BITS>(c, s)] = o;
  }
  xsum[c] = sum;
  xd[c] = pow2f(e - (BITS == 4 ? 18 : 14));
}


// Stages a bf16 row x of `chunks` 16-byte code chunks as x16, a thread of the block per chunk.
template <int BITS>
__device__ __forceinline__ void stage_x16(const bf16* x, int chunks, uint4* xi, float* xsum, float* xd) {
  constexpr int kEpc = 128 / BITS;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    float v[kEpc];
#pragma unroll
    for (int i = 0; i < kEpc / 8; ++i) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(x + c * kEpc) + i);
      const uint32_t r[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r[h]));
        v[8 * i + 2 * h] = f.x, v[8 * i + 2 * h + 1] = f.y;
      }
    }
    put_x16_chunk<BITS>(xi, xsum, xd, c, v);
  }
}

// d = c + Σ_j a.byte[j]·b.byte[j], a unsigned; b signed (dp4a_us) or unsigned (dp4a_uu).
__device__ __forceinline__ int dp4a_us(uint32_t a, uint32_t b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ int dp4a_uu(uint32_t a, uint32_t b, int c) {
  int d;
  asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Σ q·x16 of RPU rows' chunk c (16·Σ at 4 bits), the chunk's codes q[r] (16 bytes each).
template <int BITS, int RPU>
__device__ __forceinline__ void x16_dots(const uint4* xi, int c, const uint4* const* q, int* tot) {
  int A[RPU] = {}, B[RPU] = {}, C[RPU] = {}, D[RPU] = {};
#pragma unroll
  for (int s = 0; s < kX16Slots<BITS>; ++s) {
    const uint4 X = xi[x16_slot<BITS>(c, s)];
#pragma unroll
    for (int r = 0; r < RPU; ++r) {
      const uint4& w4 = *q[r];
      if constexpr (BITS == 4) {
        const uint32_t w = s == 0 ? w4.x : s == 1 ? w4.y : s == 2 ? w4.z : w4.w;
        const uint32_t lo = w & 0x0F0F0F0Fu, hi = w & 0xF0F0F0F0u;
        A[r] = dp4a_us(lo, X.x, A[r]);
        B[r] = dp4a_us(hi, X.y, B[r]);
        C[r] = dp4a_uu(lo, X.z, C[r]);
        D[r] = dp4a_uu(hi, X.w, D[r]);
      } else {
        const uint32_t w0 = s == 0 ? w4.x : w4.z, w1 = s == 0 ? w4.y : w4.w;
        A[r] = dp4a_us(w0, X.x, A[r]);
        C[r] = dp4a_uu(w0, X.y, C[r]);
        A[r] = dp4a_us(w1, X.z, A[r]);
        C[r] = dp4a_uu(w1, X.w, C[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < RPU; ++r)
    tot[r] = BITS == 4 ? (16 * A[r] + B[r]) * 256 + 16 * C[r] + D[r] : A[r] * 256 + C[r];
}

}  // namespace lily::cuda
