// gemm.cuh: decoding of MLX affine codes (architecture.md §9.3) shared by qmv.cu (GEMV) and the tensor-core GEMMs
// (qmm.cu, qmm_sm90.cu), and the tile helpers the two GEMMs share. Private to those files.
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
#include "backend/cuda/wgmma.cuh"

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

// ---- shared by the tile GEMMs of qmm.cu and qmm_sm90.cu ----

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// The (expert, row range) of flattened row tile t, where expert e owns ceil(count_e / BM) tiles in expert order.
// Block-wide (all kThreads threads of the block call it); returns false for every thread when t is past the last tile.
template <int BM, int kThreads = 256>
__device__ bool find_tile(const int32_t* offsets, int E, int t, int& e, int& r0, int& r1) {
  __shared__ int warp_tiles[kThreads / 32];
  __shared__ int hit[3];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) hit[0] = -1;
  int carry = 0;  // tiles of the experts before this pass
  for (int base = 0; base < E; base += kThreads) {
    const int ex = base + threadIdx.x;
    int lo = 0, hi = 0;
    if (ex < E) {
      lo = offsets[ex];
      hi = offsets[ex + 1];
    }
    const int cnt = hi > lo ? (hi - lo + BM - 1) / BM : 0;
    int incl = cnt;  // inclusive prefix over the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += v;
    }
    if (lane == 31) warp_tiles[warp] = incl;
    __syncthreads();
    int before = carry, total = carry;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) {
      const int v = warp_tiles[w];
      if (w < warp) before += v;
      total += v;
    }
    const int first = before + incl - cnt;
    if (t >= first && t < first + cnt) {
      hit[0] = ex;
      hit[1] = lo + (t - first) * BM;
      hit[2] = hi;
    }
    carry = total;
    __syncthreads();  // hit visible; warp_tiles free for the next pass
  }
  e = hit[0];
  r0 = hit[1];
  r1 = hit[2];
  return e >= 0;
}

// qmm_sm90.cu: the Hopper (sm_90a wgmma) form of the two tile GEMMs below, taken when sm90_gemm_applies (switch
// wgmma, 4-bit, group ≥ 64, K % 64 == 0, built for and running on sm_90a); the arguments are qmm's / moe_gemm's,
// already checked.
bool sm90_gemm_applies(const Ctx& ctx, const QMatrix& W);
void qmm_sm90(Ctx& ctx, const QMatrix& W, const bf16* x, int T, void* y, bool y_f32);
void moe_gemm_sm90(Ctx& ctx, const QMatrix& A, const QMatrix* B, const int32_t* offsets, const int32_t* rows,
                   int max_rows, int expert_rows, const bf16* x, bf16* y);

// log2 of a power of two (host).
inline int log2_exact(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

// The preconditions qmv and the GEMMs share (backend/checks.h: check_qmatrix) give one weight layout the kernels
// can read with 16-byte loads and whose 32-code runs never straddle a group.

}  // namespace lily::cuda
