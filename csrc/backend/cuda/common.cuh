// common.cuh: what every CUDA op file shares: error checks, the launch context, bf16 helpers, warp reductions and
// the MLX affine dequantisation (architecture.md §9.3). Device helpers are templates/inline so each .cu compiles
// alone.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/checks.h"
#include "backend/policy.h"
#ifdef LILY_STEP_TRACE
#include "backend/cuda/step_trace.h"
#endif
#include "backend/scratch.h"
#include "core/common.h"

namespace lily::cuda {

using bf16 = __nv_bfloat16;

#define LILY_CUDA_CHECK(expr)                                                                              \
  do {                                                                                                     \
    cudaError_t err_ = (expr);                                                                             \
    if (err_ != cudaSuccess)                                                                               \
      throw std::runtime_error(::lily::cat("CUDA error ", cudaGetErrorString(err_), " at ", __FILE__, ":", \
                                           __LINE__, ": ", #expr));                                        \
  } while (0)

// The launch context: one stream, the device's properties, the ablation switches, and scratch buffers (one per
// backend/scratch.h slot) that grow on demand. Growth happens only outside graph capture (the backend runs every
// shape once before capturing it).
struct Ctx {
  cudaStream_t stream = nullptr;
  int num_sms = 132;
  size_t smem_optin = 227 * 1024;  // max dynamic shared memory per block
  Optimisations opts;
  bool sm90a = false;  // a 9.0 device (H100/H200): the sm_90a kernels (qmm_sm90.cu) run on it when built
  bool pdl = false;  // launch with programmatic stream serialization (the replayed decode step, switch pdl)
  // The dynamic shared-memory limit each kernel has been raised to (allow_smem), shared by this Ctx's copies.
  std::shared_ptr<std::unordered_map<const void*, size_t>> smem_limits =
      std::make_shared<std::unordered_map<const void*, size_t>>();
  void* scratch(int slot, size_t bytes);
  // Switch moe_down_early (moe.cu): per decode token {tag, blocks counted}, zeroed when the backend is created, and
  // the last tag handed out (one per MoE call, never 0).
  unsigned* moe_flags = nullptr;
  unsigned moe_tag = 0;

  void* buf[kNumSlots] = {};
  size_t cap[kNumSlots] = {};
  bool capturing = false;

  // A second stream for independent work beside `stream` (fork_side / join_side); a Ctx for it (side = true) shares
  // this one's settings and allocates no scratch.
  cudaStream_t side_stream = nullptr;
  cudaEvent_t side_fork = nullptr, side_join = nullptr;
  bool side = false;
};

// Work on the side stream: the returned Ctx's kernels start after everything enqueued on ctx.stream so far.
Ctx fork_side(const Ctx& ctx);
// ctx.stream waits for everything enqueued on the side stream so far.
void join_side(const Ctx& ctx);

// ---- programmatic dependent launch (PDL, sm_90) ----------------------------------------------------------------
// In the replayed decode step with the `pdl` switch on (Ctx::pdl), every kernel is launched with programmatic stream
// serialization: it may start while its predecessor in the stream is still running. (Prefill runs without: there the
// early-launched blocks of the next kernel cost the multi-wave GEMMs 6 % at 4K.) Every kernel therefore follows one
// rule: before pdl_wait() it only reads memory that no kernel writes in the step before it (weights; a GDN layer's conv
// and recurrent state, which only that layer's own kernel writes, one step earlier, and the selection's draw counter
// likewise: an early launch never reaches back across a graph launch or a launch without PDL), and it writes nothing.
// pdl_wait() returns once the predecessor grid has completed and its writes are visible; without PDL both calls are
// no-ops. pdl_trigger() lets the successor launch (once every block of this grid has called it or exited); kernels call
// it as early as possible.
#ifdef LILY_STEP_TRACE
// The decode-step probe (step_trace.h): this file's copy of the record buffer, registered with the host side.
void step_trace_register(void (*set)(unsigned long long*));
bool step_trace_on();
void step_trace_launch(const void* kernel);
namespace {
__device__ unsigned long long* g_step_trace = nullptr;
void set_step_trace(unsigned long long* p) { LILY_CUDA_CHECK(cudaMemcpyToSymbol(g_step_trace, &p, sizeof(p))); }
[[maybe_unused]] const bool step_trace_registered = (step_trace_register(&set_step_trace), true);
}  // namespace
// n consecutive record slots of this SM's shard (step_trace.cu: kTraceShards counters, each on its own 128-byte line,
// then the shards' records), or null when the probe is off or the shard is full. One counter per SM keeps the
// probe's atomics off any one address the whole GPU shares.
__device__ __forceinline__ unsigned long long* step_trace_slots(unsigned n) {
  unsigned long long* tr = g_step_trace;
  if (!tr) return nullptr;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  sm %= kTraceShards;
  const unsigned long long per = tr[kTraceShards * kTraceLine];  // records per shard
  const unsigned long long i = atomicAdd(tr + sm * kTraceLine, static_cast<unsigned long long>(n));
  if (i + n > per) return nullptr;
  return tr + kTraceShards * kTraceLine + kTraceLine + 2 * (sm * per + i);
}
// One record: this launch's id with `flags` in its top bits, and the time.
__device__ __forceinline__ void step_trace_record(unsigned long long flags) {
  unsigned long long grid, t;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  if (unsigned long long* r = step_trace_slots(1)) r[0] = grid | flags, r[1] = t;
}
// start: the record is a block's pdl_trigger (its first instructions, before the wait; every block records one),
// flagged by the grid id's top bit; else it is block 0 passing its PDL wait.
__device__ __forceinline__ void step_trace_mark(bool start) {
  if (threadIdx.x || (!start && (blockIdx.x || blockIdx.y || blockIdx.z))) return;
  step_trace_record(start ? 1ull << 63 : 0);
}
// A phase inside a kernel (the calling thread's): the grid id's bit 62 set and the phase number in bits 56-61.
__device__ __forceinline__ void step_trace_phase(int phase) {
  step_trace_record(1ull << 62 | static_cast<unsigned long long>(phase & 63) << 56);
}
#define LILY_TRACE_PHASE(p) step_trace_phase(p)
// Up to N phase times of one thread, kept in registers and recorded together by record(): one atomic for all, after
// the work they time, so that the probe adds no round trip between them. Phase first + i is the i-th mark.
template <int N>
struct TracePhases {
  unsigned t[N];  // the timer's low 32 bits (ns): record() restores the high ones, so a mark costs one register
  __device__ __forceinline__ void mark(int i) { asm volatile("mov.u32 %0, %%globaltimer_lo;" : "=r"(t[i])); }
  // The mark once v is in a register: v a word of the loads to wait for (xor several to wait for all). The timer
  // read is predicated on v, so that neither compiler can hoist it above v's loads (v = ~0, one word in 2^32,
  // records the start of the timer's 4.3-second period instead).
  __device__ __forceinline__ void mark_on(int i, unsigned v) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.u32 p, %1, 0xFFFFFFFF;\n mov.u32 %0, 0;\n @p mov.u32 %0, %%globaltimer_lo;\n}"
        : "=r"(t[i])
        : "r"(v));
  }
  __device__ __forceinline__ void record(int first, int n = N) {
    unsigned long long grid, now;
    asm volatile("mov.u64 %0, %%gridid;" : "=l"(grid));
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    unsigned long long* r = step_trace_slots(n);
    if (!r) return;
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < n) {  // the mark's time: now's high bits, one wrap of the low ones back if the mark is past now's
        const unsigned long long hi = (now & ~0xFFFFFFFFull) - (t[i] > unsigned(now) ? 1ull << 32 : 0);
        r[2 * i] = grid | 1ull << 62 | static_cast<unsigned long long>((first + i) & 63) << 56;
        r[2 * i + 1] = hi | t[i];
      }
  }
};
#else
#define LILY_TRACE_PHASE(p) ((void)0)
template <int N>
struct TracePhases {
  __device__ __forceinline__ void mark(int) {}
  __device__ __forceinline__ void mark_on(int, unsigned) {}
  __device__ __forceinline__ void record(int, int = N) {}
};
#endif
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef LILY_STEP_TRACE
  step_trace_mark(false);
#endif
}
__device__ __forceinline__ void pdl_trigger() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#ifdef LILY_STEP_TRACE
  step_trace_mark(true);  // after the trigger, so that the probe's atomic does not hold the successor's launch back
#endif
}

// Launches kernel<<<grid, block, smem, ctx.stream>>>(args…), with the PDL attribute when the switch is on.
template <typename... Params, typename... Args>
void launch(const Ctx& ctx, void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, Args&&... args) {
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = ctx.stream;
  cfg.attrs = attr;
  cfg.numAttrs = ctx.pdl ? 1 : 0;
#ifdef LILY_STEP_TRACE
  if (ctx.capturing && step_trace_on()) step_trace_launch(reinterpret_cast<const void*>(kernel));
#endif
  LILY_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...));
}

// Raises kernel's dynamic shared-memory limit to `bytes` (needed past 48 KB, or once static shared memory is added),
// calling the driver only when the limit grows.
template <typename Kernel>
void allow_smem(const Ctx& ctx, Kernel kernel, size_t bytes) {
  size_t& have = (*ctx.smem_limits)[reinterpret_cast<const void*>(kernel)];
  if (bytes <= have) return;
  LILY_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  have = bytes;
}

// Largest T of the fp32 GEMV (one pass over the weights, x in shared memory); above it, tensor cores.
constexpr int kQmvMaxT = 8;
// Largest T of the tensor-core GEMV (qmv.cu, switch qmv_mma): a short prompt tail, its tokens the 16 rows of an mma.
constexpr int kQmvShortMaxT = 16;

__host__ __device__ inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over a block of blockDim.x threads (multiple of 32, ≤ 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float part[32];
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) part[wid] = v;
  __syncthreads();
  float r = lane < nw ? part[lane] : 0.0f;
  return warp_sum(r);
}

// Four bf16 values through one 8-byte access (p 8-byte aligned).
__device__ __forceinline__ float4 load_bf16x4(const bf16* p) {
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

__device__ __forceinline__ void store_bf16x4(bf16* p, float4 v) {
  const __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<const uint32_t*>(&a);
  u.y = *reinterpret_cast<const uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = u;
}

// Two floats as one bf16 pair (lo in the low half: the element of the lower index in a tensor-core fragment).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// c[16×8] += a[16×16] · b[16×8] on the tensor cores (mma.sync m16n8k16): a row-major (4 regs of bf16 pairs),
// b "col" (2 regs: k pairs of one column), c fp32 (4 regs). Fragment layouts: PTX ISA, mma.m16n8k16.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float to_f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float bf16_bits_to_f(uint16_t b) { return __uint_as_float(uint32_t(b) << 16); }
__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + __expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x / (1.0f + __expf(-x)); }

// Dequantise the 32/bits codes of one packed word: out[j] = s·q_j + b, element j at bit offset bits·j (LSB first).
template <int BITS>
__device__ __forceinline__ void dequant_word(uint32_t w, float s, float b, float* out) {
  constexpr int n = 32 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1u;
#pragma unroll
  for (int j = 0; j < n; ++j) out[j] = fmaf(s, float((w >> (BITS * j)) & mask), b);
}

// Dispatch a runtime bit width (4 or 8) to a template parameter.
template <typename F>
void dispatch_bits(int bits, F&& f) {
  if (bits == 4)
    f(std::integral_constant<int, 4>{});
  else if (bits == 8)
    f(std::integral_constant<int, 8>{});
  else
    throw InputError(cat("CUDA backend: unsupported bit width ", bits));
}

inline void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(cat("CUDA launch of ", what, " failed: ", cudaGetErrorString(e)));
}

}  // namespace lily::cuda
