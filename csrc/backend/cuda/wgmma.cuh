// wgmma.cuh: the Hopper (sm_90a) warpgroup MMA, its shared-memory descriptors and fences, for the kernels built for
// sm_90a: qmm_sm90.cu (the 4-bit GEMMs) and attention.cu (the prefill attention on wgmma); and the 128-byte swizzle,
// which qmm.cu's mma.sync tiles use too (through gemm.cuh). Private to those files.
//
// Shapes   d[64 × N] (+)= a[64 × 16] · b[16 × N], bf16 inputs, fp32 accumulators, N ∈ {16, 32, 64, 128}. The
//          accumulators are the m16n8 C layout per warp (warp w of the warpgroup rows 16w .. 16w + 15): d[4j + e] is
//          row lane/4 + 8·(e/2), column 8j + 2·(lane mod 4) + e mod 2. A from registers (rs) is the m16n8k16 A
//          fragment per warp; A from shared memory (ss) is K-major like B.
// Layouts  K-major (trans 0): rows of 64 bf16 (128 bytes) in the 128-byte swizzle (16-byte chunk c of row r at
//          r·128 + ((c ⊕ r) mod 8)·16, the tile 1024-byte aligned), 8-row groups 1024 bytes apart; a k16 step inside
//          the 64 columns advances the start address by 32 bytes. MN-major B (trans 1, bf16 only): the same physical
//          tile read as [k][n], i.e. row r = k index holding 64 consecutive n; 8 k-rows 1024 bytes apart (SBO) and
//          the next 64 n at LBO (PTX ISA, "Shared Memory Matrix Layout": canonical ((8,8,m),(8,k)) : ((1,8,LBO),
//          (64,SBO)) in elements).
// Ordering every thread that wrote shared memory by ordinary stores or cp.async runs fence_proxy_async() before
//          the barrier that precedes the wgmma reading it; accumulators and A registers are not touched between an
//          issue and the wait that retires it (fence_acc keeps the compiler from moving accesses across).
#pragma once
#include <cstdint>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LILY_SM90A_DEVICE 1
#endif

namespace lily::cuda {

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading byte offset (MN-major: the next 64
// columns; unused for K-major, 16), stride byte offset 1024 (the next 8 rows).
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo = 16) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo & 0x3FFFF) >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// Byte offset of 16-byte chunk kc (0..7) of 128-byte tile row `row`: chunk XOR (row mod 8). With the tile 1024-byte
// aligned this is also the hardware's 128-byte swizzle, the layout wgmma reads (qmm_sm90.cu, attention.cu).
__device__ __forceinline__ uint32_t swz(int row, int kc) {
  return uint32_t(row * 128 + (((kc ^ row) & 7) << 4));
}

// The 1024-aligned start of a kernel's dynamic shared memory (its launch asks for 1024 bytes of slack).
__device__ __forceinline__ char* aligned_1k(char* raw, uint32_t& sbase) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  sbase = (a + 1023u) & ~1023u;
  return raw + (sbase - a);
}

// Keeps the compiler from moving accesses to the accumulators across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_acc(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

#ifdef LILY_SM90A_DEVICE
// Wgmma<N>::rs<TB>: A from registers, B by descriptor (TB: 0 K-major, 1 MN-major). Wgmma<64>::ss: A and B by
// descriptor, both K-major (the only width attention.cu needs). scale_d = 0: d = a·b (the first step, so the accumulators need no zeroing).
// A PTX instruction takes a fixed operand list, so each width is its own asm statement.
template <int N>
struct Wgmma;

template <>
struct Wgmma<16> {
  template <int TB>
  __device__ __forceinline__ static void rs(float* d, const uint32_t* a, uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, %14;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TB));
  }
};

template <>
struct Wgmma<32> {
  template <int TB>
  __device__ __forceinline__ static void rs(float* d, const uint32_t* a, uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TB));
  }
};

template <>
struct Wgmma<64> {
  template <int TB>
  __device__ __forceinline__ static void rs(float* d, const uint32_t* a, uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TB));
  }
  __device__ __forceinline__ static void ss(float* d, uint64_t da, uint64_t db, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(scale_d));
  }
};

template <>
struct Wgmma<128> {
  template <int TB>
  __device__ __forceinline__ static void rs(float* d, const uint32_t* a, uint64_t desc, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d), "n"(TB));
  }
};

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif

}  // namespace lily::cuda
