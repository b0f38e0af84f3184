// moe.cu: the sparse MoE block (architecture.md §6): router, softmax, top-k, SwiGLU experts, gated shared expert.
//
// Math     ℓ = m·W_routerᵀ;  P = softmax(ℓ) (fp32);  top-k by P, ties → lower expert id;
//          ŵ_e = P_e / Σ_topk P (norm_topk_prob) else P_e;
//          y_e = W_down[e]·(silu(W_gate[e]·m) ⊙ (W_up[e]·m));  s = W_sd·(silu(W_sg·m) ⊙ (W_su·m));
//          γ = σ(m·w_seg);  out = Σ_topk ŵ_e·y_e + γ·s   (fp32 accumulation, bf16 out)
//          Decode dots use the MLX identity per 32-code chunk of one group:
//          Σ_k (s·q_k + b)·x_k = s·Σ q_k·x_k + b·Σ x_k, with q made a float by one byte permute (no I2F):
//          4-bit gives 128 + q (so s·(Σ(128+q)x − 128·Σx)), 8-bit gives q exactly (2^23 + q − 2^23).
// Layout   m, out bf16[T, H]; experts W_gate/W_up u32[E, I, H·bits/32], W_down u32[E, H, I·bits/32], s/b bf16
//          [E, N, K/group] (§9.3); shared [IS, H], [IS, H], [H, IS]; router [E, H]; w_seg [1, H].
//          Scratch: logits f32[T, E]; route {ids i32[T, k], ŵ f32[T, k], γ f32[T]};
//          prefill: sort {offsets i32[E+1], rows i32[T·k], pos i32[T·k]}, h bf16[T·k, I], yd bf16[T·k, H],
//          shared {g, u f32[T, IS], h bf16[T, IS], s bf16[T, H]};  decode: h f32[T, k+1, max(I, IS)].
// Traffic  real shape (H 2048, E 256, k 8, I = IS 512, experts 4-bit, router/w_seg 8-bit), decode T=1:
//          router 0.557 MB + 8 experts 14.156 MB + shared 1.769 MB + w_seg 2 KB = 16.48 MB per layer.
// Work     decode 2·(256·2048 + 9·3·512·2048) = 57.7 MFLOP → 3.5 FLOP/B: bandwidth-bound.
//          Floor: 16.48 MB @ 4.8 TB/s = 3.4 µs per layer (137 µs per token over 40 layers).
//          Prefill T=4096: routed 206.2 + shared 25.8 + router 4.3 = 236 GFLOP per layer → 0.36 ms at 660 TFLOP/s
//          (tensor cores, in moe_gemm/qmm); the kernels of this file only move T·k·H·2 B (128 MB at T=4096).
// Mapping  Both paths: router logits by qmm (f32); moe_route_kernel: one warp per token, E/32 probabilities per
//          lane, k rounds of warp argmax; the same warp computes γ (decode runs it only with route_fused off).
//          Prefill (T > kMoeDecodeMaxT, or shapes the decode kernels do not take): moe_sort_kernel, one block per
//          expert, counts the (token, slot) pairs routed below / to it (offsets) and scatters its pairs in (token,
//          slot) order (ballot prefix scan, no atomics) → rows, pos; moe_gemm gate+up (SwiGLU fused) → h;
//          moe_gemm down → yd; shared expert by qmm + moe_swiglu_kernel + qmm; moe_combine_kernel: one thread
//          per 8 outputs sums ŵ·yd[pos] over the k slots, then γ·s.
//          Decode: moe_gate_up_kernel: block = (token, slot j ∈ k routed + shared, tile of rows); each warp
//          holds its lanes' chunks of m (fp32) in registers and computes gate AND up rows with 16-byte code loads,
//          SwiGLU in registers → h f32. Real shape: lane = 2 chunks of a row of 2048, 2 rows per warp with all 8
//          code loads in flight, 4 warps per block, 9 × 64 blocks. moe_down_kernel: block = (token, tile of
//          rb output rows), warp j = slot j (routed experts, then the shared one), each lane one 16-byte chunk of a
//          row of W_down[e_j]; real shape: 16 lanes per row of 512, 8 rows per block (4 loads in flight per lane),
//          256 blocks of 9 warps; the ŵ/γ-weighted partials meet in shared memory, summed in slot order.
//          Switch route_fused (decode): no routing kernel; every routed warp of moe_gate_up_kernel runs route_warp's
//          top-k from the router logits up to its own slot (the same float operations, so every warp agrees), and
//          block 0 of each token writes the routing and γ for moe_down_kernel. Switch route_logits (with it): the warps
//          pick on the logits (pick_round: a three-level tree per lane, no softmax before the picks; the probabilities
//          only for block 0's weights, computed as route_warp computes them), the same experts and weights bit for bit
//          but where two distinct logits round to one probability.
//          Switch moe_down_early (with route_fused): block 0's routing warp releases the ids under a tag of this
//          MoE call (st.release, a flag per token); each down block's thread 0 polls it (ld.acquire), and its routed
//          warps load their experts' first codes before the PDL wait; the last down block clears the flag.
//          Switch moe_dp4a (decode): each gate+up block stages m once in shared memory in 16-bit fixed point
//          (x16.cuh) and its dot products run on dp4a (~0.75 instructions per 4-bit code instead of ~2.4).
//          Registers (sm_90, -O3): gate_up 128 (4-bit) / 125 (8-bit), with moe_dp4a 127 / 107; down 96 / 83 (held
//          at 96 by __maxnreg__: moe_down_early's instance would take 98), route 32-48, others ≤ 32; no spills.
//          Keep down at 96 or fewer: at 103 only half its blocks got onto the SMs beside gate+up's before the wait,
//          and a layer took 3 µs longer (benchmarks/NOTES.md, session 51).
// Checks   shapes of every matrix against MoeArgs; bits 4/8; K % group == 0; 1 ≤ top_k ≤ min(E, 32); E ≤ 256;
//          H % 8 == 0; m, out 16-byte aligned. The decode kernels also need: top_k ≤ 15, one bit width for
//          gate/up/shared gate/up and one for down/shared down, H ≤ 2048, I and IS ≤ 1024 (4-bit) / 512 (8-bit),
//          group a multiple of the 32 (4-bit) / 16 (8-bit) codes of a 16-byte chunk, 16-byte aligned codes;
//          otherwise the prefill path runs (any T).
// Ref      cpu/moe.cpp · Test tests/ops/cases.py op="moe" · Bench benchmarks/bench_ops.py -o moe
// History  v1 · v2 (2026-12-01) moe_sort_scan_kernel (switch moe_sort_scan): 47.8 µs per layer at T = 4096
//          instead of 98.8; the residual added in the last kernel (moe_residual); the shared expert's codes loaded
//          before the PDL wait in the decode kernels. Tried and removed: router GEMV + softmax + top-k + shared gate
//          in one kernel with a last-block-arrival tail (8.5 µs against 4.1 + 10.7, but −9.5 % decode end to end).
//          v3 (2026-12-02) moe_route_block_kernel (switch route_block, one block per token): decode 457 → 506 tok/s
//          at 4K on the H200. Removed in session 42: once route_fused routed decode inside the gate+up kernel, it
//          measured +0.21 % decode (H200) and −0.83 / −0.46 % prefill at 4K (H100, benchmarks/NOTES.md).
//          v4 (2026-12-03) the routing inside moe_gate_up_kernel (switch route_fused): decode +3.1 % / +3.5 % at 4K,
//          +2.8 % at 32K (benchmarks/probes/ab_decode.py). Tried and removed: moe_down_kernel routing itself before
//          its PDL wait, gate+up triggering its successor only after its own wait (so that the router had finished):
//          decode 560 → 509 tok/s at 4K, the down kernel launched too late; gate+up blocks prefetching their
//          expert's down rows into L2 (cp.async.bulk.prefetch.L2): −0.7 %.
//          Tried and removed (2026-12-03, benchmarks/NOTES.md v13): the down kernel's routed warps loading their codes
//          before the PDL wait once a counter released by the routing warp says the ids are out (+0.7 %); gate+up and
//          down as one kernel, down tiles handed out by a counter after the gate+up tiles (37.0 µs standalone against
//          25.1 µs for the two kernels, decode −19.7 %).
//          v5 (2026-12-04) route_logits: decode +3.5 % / +3.3 % at 4K / 32K. A routed warp's top-k took
//          ~1.9 µs before its first code load (one warp, clock64: logits 450 cycles, softmax 1,535, eight rounds
//          1,725); the picks need no softmax and take 1,417 cycles for eight rounds. Tried and removed (NOTES.md v15):
//          the whole MoE of a token in one kernel of 18 clusters of 8 blocks (moe_cluster, weights bulk-copied into
//          shared memory, h through distributed shared memory, a last-arrival sum): decode −17 %.
//          Tried and removed (2026-12-05/06, benchmarks/NOTES.md sessions 40-41, H100): route_sorted (the picks by
//          a sorted list per lane, the routed slots descending): +2.6 % against its own build with the switch off, but
//          that build decoded 3.3 % slower at 4K than this file's without the switch; the gate+up kernel at five
//          blocks an SM so that its 576 blocks fit one wave (moe_gu_one_wave): −2.6 %; the shared expert's blocks
//          taking four tiles each in turn so that the kernel fits one wave (moe_shared_wide): −6 to −7 %; this kernel
//          specialised on route_logits, 54 KB of code instead of 72 at the same registers (gu_slim): +0.3 %.
//          v6 (2026-12-06) norm_fold (switch, one token): the mixer's output projection adds into x and leaves Σx²
//          by block and x ⊙ w; the router's streaming GEMV folds the post-mixer norm in (qmv.cu v7) and writes m for
//          the experts: no norm kernel between them.
//          v7 (current, 2026-12-07) moe_down_early (switch, with route_fused): v13's idea rebuilt for v21's step,
//          whose down blocks are resident before their PDL wait: a tag per MoE call released by the routing warp,
//          the routed warps' codes loaded before the wait. H100, 4K: +1.07 / +1.39 % inside the build, +0.86 /
//          +1.47 % sampled against the build without it; 32K +0.29 %; the down kernel 7.04 → 6.14 µs a layer on
//          the step's critical path (benchmarks/NOTES.md, session 53). Tried and removed (session 54, H100):
//          moe_down_stage, the down block copying h into shared memory with coalesced loads for its lanes to read
//          there (a warp's own loads of h touch 16 lines): the trace's down kernel 6.30 → 5.81 µs a layer, the
//          shipped step −0.21 % at 4K. Tried and removed (session 55, H100): prefetch_next_layer, thread 0 of each
//          down block issuing its share of the next layer's input projections as L2 bulk prefetches after the wait:
//          the projections −0.95 µs a call, the down kernel +2.1 µs, the shipped step +0.00 % at 4K. The step
//          trace's phases (TracePhases, common.cuh) are marked in both decode kernels; a LILY_STEP_TRACE build keeps
//          the register counts above, a shipped build has no trace of them.
#include <algorithm>

#include "backend/checks.h"
#include "backend/cuda/ops.cuh"
#include "backend/cuda/x16.cuh"

namespace lily::cuda {

namespace {

constexpr int kMoeDecodeMaxT = kQmvMaxT;  // T at most this: the fused decode kernels
constexpr int kMaxExperts = kMoeMaxExperts;  // routing keeps E/32 ≤ 8 probabilities per lane (backend/checks.h)
constexpr int kRouteWarps = 4;            // tokens per routing block
constexpr int kSortThreads = 1024;
constexpr int kCombineThreads = 128;
constexpr int kSwigluThreads = 256;
constexpr int kGuWarps = 4;               // warps per gate_up block
// Rows per gate_up warp (per lane group), all loaded before the first is used: 2 for 4-bit (64 x registers +
// 8 code chunks fit 128 registers), 1 for 8-bit (its chunks hold half the codes, so twice the loads per row).
template <int BITS>
constexpr int kGuSteps = BITS == 4 ? 2 : 1;
constexpr int kDownSteps = 4;             // row steps per down warp (of the widest row mapping)
constexpr int kDownMaxWarps = 16;         // down block: k routed + 1 shared warps
constexpr int kMaxHidden = 2048;          // decode: m chunks held in registers

int pow2_at_least(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

// One matrix or a stack of E, as the kernels read it (the shapes come from MoeArgs). Expert e starts at row e·N.
struct QStack {
  const uint32_t* w;
  const uint16_t* s;
  const uint16_t* b;
  int group;
};
QStack stack_of(const QMatrix& q) { return {q.w, q.scales, q.biases, q.group}; }

// Where the routing lands (backend/scratch.h): per token the k expert ids, their weights ŵ, and γ.
using Route = MoeRoute;

// Everything the two decode kernels read. lpr_gu: lanes per row for K = H (a power of two ≤ 32);
// rb_gu rows per gate_up block, tiles_gu blocks per slot; rb_down output rows per down block.
struct DecodeArgs {
  QStack gate, up, down, sgate, sup, sdown;
  const bf16* m;
  int32_t* ids;
  float* wts;
  float* gamma;
  float* h;  // [T, k+1, hs]
  bf16* out;              // [T, H], unless resid is set
  float* resid;           // if set: resid += MoE(m) (fp32 [T, H]) instead of writing out
  int T, H, k, I, IS, hs;
  int lpr_gu, rb_gu, tiles_gu, rb_down;
  // Switch route_fused: the routing from the router's logits [T, E] in moe_gate_up_kernel (null: a routing kernel
  // wrote ids, wts and gamma before it); seg is the shared expert's gate w_seg.
  const float* logits;
  QStack seg;
  int seg_bits, E;
  bool norm_topk;
  bool pick_logits;  // switch route_logits: pick_expert / pick_route instead of route_warp
  // Switch moe_down_early (with route_fused): per token {tag, blocks counted} (Ctx::moe_flags); the routing block
  // releases the ids under this call's tag, and moe_down_kernel's routed warps load their codes once it is out.
  unsigned* flags;
  unsigned tag;
};

// ---- device helpers -----------------------------------------------------------------------------------------------

// Sum over the lpr lanes (an aligned power-of-two group) that share a row; every lane gets its group's sum.
__device__ __forceinline__ float group_sum(float v, int lpr) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < lpr) v += __shfl_xor_sync(0xffffffffu, v, o);  // lpr is warp-uniform
  return v;
}

// Switch moe_down_early. Token t's routing warp has written ids[t] (lanes < k): every lane fences its writes, and
// lane 0 releases the call's tag to moe_down_kernel (flag[0]). The tag is this call's alone among the MoE calls that
// can overlap (Ctx::moe_tag), and flag[0] is back to 0 once every down block of the call has seen it (count_block), so
// a down block never takes an earlier call's ids.
__device__ __forceinline__ void release_routing(unsigned* flag, unsigned tag) {
  __threadfence();
  __syncwarp();
  if ((threadIdx.x & 31) == 0) asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flag), "r"(tag) : "memory");
}

// The down block's wait for release_routing's tag (one thread).
__device__ __forceinline__ void await_routing(const unsigned* flag, unsigned tag) {
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
    if (v == tag) return;
    __nanosleep(64);
  }
}

// The down block has passed await_routing (one thread): the last of the call's blocks clears the tag and the count.
__device__ __forceinline__ void count_block(unsigned* flag, unsigned blocks) {
  if (atomicAdd(flag + 1, 1u) != blocks - 1) return;
  asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(flag + 1) : "memory");
  asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(flag) : "memory");
}

// 2·n bf16 packed in n words to fp32.
template <int n>
__device__ __forceinline__ void bf16_words_to_f(const uint32_t* w, float* f) {
#pragma unroll
  for (int i = 0; i < n; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
  }
}
// 8 bf16 (one 16-byte load) to fp32.
__device__ __forceinline__ void bf16x8_to_f(uint4 u, float* f) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
  bf16_words_to_f<4>(w, f);
}

// Dot of one 16-byte chunk of codes (128/BITS codes, all in one group with scale s and bias b) with x[0..codes),
// whose sum is xs:  Σ (s·q + b)·x = s·Σ q·x + b·xs.
template <int BITS>
__device__ __forceinline__ float chunk_dot(uint4 q, const float* x, float xs, float s, float b) {
  const uint32_t wd[4] = {q.x, q.y, q.z, q.w};
  float a0 = 0.0f, a1 = 0.0f;
  if constexpr (BITS == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // byte j of lo holds code 2j, of hi code 2j+1; under exponent byte 0x43 a code byte reads 128 + q
      const uint32_t lo = wd[i] & 0x0F0F0F0Fu, hi = (wd[i] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t sel = 0x7044u | (uint32_t(j) << 8);  // bytes: 0, 0, code byte j, 0x43
        a0 = fmaf(__uint_as_float(__byte_perm(lo, 0x43000000u, sel)), x[8 * i + 2 * j], a0);
        a1 = fmaf(__uint_as_float(__byte_perm(hi, 0x43000000u, sel)), x[8 * i + 2 * j + 1], a1);
      }
    }
    return s * ((a0 + a1) - 128.0f * xs) + b * xs;  // s·Σ(128 + q)·x − 128·s·Σx + b·Σx
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {  // bytes: code byte j, 0, 0, 0x4B → 2^23 + q, minus 2^23 exactly
        const float qf = __uint_as_float(__byte_perm(wd[i], 0x4B000000u, 0x7440u | uint32_t(j))) - 8388608.0f;
        if (j & 1)
          a1 = fmaf(qf, x[4 * i + j], a1);
        else
          a0 = fmaf(qf, x[4 * i + j], a0);
      }
    }
    return s * (a0 + a1) + b * xs;
  }
}

__device__ __forceinline__ uint4 load16(const uint32_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// ---- kernels: routing (both paths) --------------------------------------------------------------------------------

// Order-preserving map of a float to an unsigned key (and back), so that redux.sync's unsigned max finds a float max.
__device__ __forceinline__ unsigned float_key(float f) {
  const unsigned b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}
__device__ __forceinline__ float key_float(unsigned k) {
  return __uint_as_float((k & 0x80000000u) ? k & 0x7fffffffu : ~k);
}

// Warp-wide: P = softmax(ℓ) over E ≤ kMaxExperts logits (lane l holds ℓ[l + 32·i] in p[i], -inf past E), the top-k
// by P (ties → lower id), and ŵ = P / Σ_topk P (norm_topk) or P; lane j < k writes slot j of ids and wts (ids set).
// Returns the id the last of the rounds run won (every lane), rounds ≤ k of them: slot rounds − 1's expert.
// REDUX (the gate+up kernel's routing, switch route_fused): the maxima by redux.sync (one instruction each) instead
// of five shuffle rounds; the same values, the same order.
template <bool REDUX>
__device__ __forceinline__ int route_warp(float (&p)[kMaxExperts / 32], int E, int k, bool norm_topk, int32_t* ids,
                                          float* wts, int rounds) {
  constexpr int kPer = kMaxExperts / 32;
  const int lane = threadIdx.x & 31;
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) mx = fmaxf(mx, p[i]);
  if constexpr (REDUX)
    mx = key_float(__reduce_max_sync(0xffffffffu, float_key(mx)));
  else
    mx = warp_max(mx);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    p[i] = lane + 32 * i < E ? expf(p[i] - mx) : 0.0f;  // exp(ℓ − max ℓ)
    sum += p[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPer; ++i) p[i] = lane + 32 * i < E ? p[i] / sum : -1.0f;  // P; -1 marks "not a candidate"

  // k rounds of argmax over (P desc, id asc); the winner is marked -1. Lane j keeps round j's winner.
  float mine = 0.0f, topsum = 0.0f;
  int mine_id = 0, last = 0;
  for (int j = 0; j < rounds; ++j) {
    float v = -2.0f;
    int id = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (p[i] > v) {  // ids ascend with i: strict > keeps the lower id on a tie
        v = p[i];
        id = lane + 32 * i;
      }
    if constexpr (REDUX) {
      // P ∈ [0, 1] keyed by its bits + 1 (monotonic for non-negative floats), a removed or absent one by 0; then the
      // lowest id holding the maximum
      const unsigned key = v >= 0.0f ? __float_as_uint(v) + 1u : 0u;
      const unsigned best = __reduce_max_sync(0xffffffffu, key);
      id = __reduce_min_sync(0xffffffffu, key == best ? id : 0x7fffffff);
      v = __uint_as_float(best - 1u);
    } else {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oid = __shfl_xor_sync(0xffffffffu, id, o);
        if (ov > v || (ov == v && oid < id)) {
          v = ov;
          id = oid;
        }
      }
    }
    if (lane == j) {
      mine = v;
      mine_id = id;
    }
    last = id;
    topsum += v;  // Σ_topk P, in the reference's order (descending P)
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i == id) p[i] = -1.0f;
  }
  if (ids && lane < k) {
    ids[lane] = mine_id;
    wts[lane] = norm_topk ? mine / topsum : mine;  // ŵ = P / Σ_topk P
  }
  return last;
}

// Switch route_logits: the same top-k picked on the logits ℓ, without the softmax first. exp and the division by one
// sum keep the order of ℓ, so the picks are route_warp's (P desc, ties → lower id) except where two distinct logits
// round to one probability: there the larger logit wins. Each round takes the lane's largest remaining key by a
// three-level tree (the left operand always holds the lower index, so strict > keeps it on ties) instead of a chain
// over the lane's candidates, then the warp's maximum by redux.sync and the lowest id holding it; the winner's key
// becomes 0 (below every logit's: float_key(-inf) = 0x007fffff). Returns the id; best = its key.
__device__ __forceinline__ int pick_round(unsigned (&u)[kMaxExperts / 32], unsigned& best) {
  static_assert(kMaxExperts / 32 == 8, "pick_round: a tree over 8 candidates per lane");
  const int lane = threadIdx.x & 31;
  unsigned a0 = u[0], a1 = u[2], a2 = u[4], a3 = u[6];
  int i0 = 0, i1 = 2, i2 = 4, i3 = 6;
  if (u[1] > a0) a0 = u[1], i0 = 1;
  if (u[3] > a1) a1 = u[3], i1 = 3;
  if (u[5] > a2) a2 = u[5], i2 = 5;
  if (u[7] > a3) a3 = u[7], i3 = 7;
  if (a1 > a0) a0 = a1, i0 = i1;
  if (a3 > a2) a2 = a3, i2 = i3;
  if (a2 > a0) a0 = a2, i0 = i2;
  best = __reduce_max_sync(0xffffffffu, a0);
  const int id = __reduce_min_sync(0xffffffffu, a0 == best ? lane + 32 * i0 : 0x7fffffff);
#pragma unroll
  for (int i = 0; i < kMaxExperts / 32; ++i)
    if (lane + 32 * i == id) u[i] = 0u;
  return id;
}

// Switch route_logits: the expert of round rounds − 1 (slot rounds − 1), from a warp's p[] of ℓ (load_logits).
__device__ __forceinline__ int pick_expert(const float (&p)[kMaxExperts / 32], int rounds) {
  unsigned u[kMaxExperts / 32], best;
#pragma unroll
  for (int i = 0; i < kMaxExperts / 32; ++i) u[i] = float_key(p[i]);
  int id = 0;
  for (int j = 0; j < rounds; ++j) id = pick_round(u, best);
  return id;
}

// Switch route_logits: route_warp's outputs (lane j < k writes ids[j], wts[j]) with the picks of pick_round; the
// probabilities of the picked experts as route_warp computes them (the same max, sum and division), Σ_topk P added
// in slot order.
__device__ __forceinline__ void pick_route(const float (&p)[kMaxExperts / 32], int E, int k, bool norm_topk,
                                           int32_t* ids, float* wts) {
  const int lane = threadIdx.x & 31;
  unsigned u[kMaxExperts / 32], best;
#pragma unroll
  for (int i = 0; i < kMaxExperts / 32; ++i) u[i] = float_key(p[i]);
  float mx = 0.0f, mine = 0.0f;
  int mine_id = 0;
  for (int j = 0; j < k; ++j) {
    const int id = pick_round(u, best);
    const float l = key_float(best);
    if (j == 0) mx = l;  // the first pick is the largest logit
    if (lane == j) {
      mine = l;
      mine_id = id;
    }
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxExperts / 32; ++i) sum += lane + 32 * i < E ? expf(p[i] - mx) : 0.0f;
  sum = warp_sum(sum);
  const float P = expf(mine - mx) / sum;
  float topsum = 0.0f;
  for (int j = 0; j < k; ++j) topsum += __shfl_sync(0xffffffffu, P, j);
  if (lane < k) {
    ids[lane] = mine_id;
    wts[lane] = norm_topk ? P / topsum : P;
  }
}

// A warp's p[] of route_warp: lane l gets ℓ[l + 32·i] of the logits row lr, -inf past E.
__device__ __forceinline__ void load_logits(const float* lr, int E, float (&p)[kMaxExperts / 32]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int i = 0; i < kMaxExperts / 32; ++i) p[i] = lane + 32 * i < E ? lr[lane + 32 * i] : -INFINITY;
}

// dot += w_seg word wi (its kPerWord codes, dequantised with scale s, bias b) · x[0 .. kPerWord).
template <int SEG_BITS>
__device__ __forceinline__ void seg_dot(uint32_t w, float s, float b, const bf16* x, float& dot) {
  constexpr int kPerWord = 32 / SEG_BITS;
  uint32_t xw[kPerWord / 2];
  if constexpr (kPerWord == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(x);
    xw[0] = u.x, xw[1] = u.y, xw[2] = u.z, xw[3] = u.w;
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(x);
    xw[0] = u.x, xw[1] = u.y;
  }
  float v[kPerWord], xv[kPerWord];
  dequant_word<SEG_BITS>(w, s, b, v);
  bf16_words_to_f<kPerWord / 2>(xw, xv);
#pragma unroll
  for (int j = 0; j < kPerWord; ++j) dot = fmaf(v[j], xv[j], dot);
}

// γ = σ(mr·w_seg) over one warp (every lane gets it): lane owns packed words lane, lane + 32, … and the kPerWord
// values of mr under each.
template <int SEG_BITS>
__device__ __forceinline__ float seg_gate_warp(const QStack& seg, const bf16* mr, int H) {
  constexpr int kPerWord = 32 / SEG_BITS;
  const int words = H / kPerWord;
  float dot = 0.0f;
#pragma unroll 4
  for (int wi = threadIdx.x & 31; wi < words; wi += 32) {
    const int g = wi * kPerWord / seg.group;  // group % kPerWord == 0: a word stays in one group
    seg_dot<SEG_BITS>(seg.w[wi], bf16_bits_to_f(seg.s[g]), bf16_bits_to_f(seg.b[g]), mr + wi * kPerWord, dot);
  }
  return 1.0f / (1.0f + expf(-warp_sum(dot)));
}

// One warp per token t: the routing of route_warp from logits[t], and γ = σ(m[t]·w_seg).
template <int SEG_BITS>
__global__ void __launch_bounds__(kRouteWarps * 32)
    moe_route_kernel(const float* logits, const bf16* m, QStack seg, int T, int E, int k, int H, bool norm_topk,
                     Route r) {
  pdl_trigger();
  pdl_wait();
  constexpr int kPer = kMaxExperts / 32;
  const int lane = threadIdx.x & 31, t = blockIdx.x * kRouteWarps + (threadIdx.x >> 5);
  if (t >= T) return;  // whole warps only; no block barrier below
  float p[kPer];
  load_logits(logits + size_t(t) * E, E, p);
  route_warp<false>(p, E, k, norm_topk, r.ids + size_t(t) * k, r.wts + size_t(t) * k, k);
  const float gamma = seg_gate_warp<SEG_BITS>(seg, m + size_t(t) * H, H);
  if (lane == 0) r.gamma[t] = gamma;
}

// ---- kernels: prefill ---------------------------------------------------------------------------------------------

// Block e: offsets[e] = #pairs routed to experts < e (offsets[E] = T·k from the last block), then its own pairs
// p = t·k + j in increasing p: rows[offsets[e] + rank] = t, pos[p] = offsets[e] + rank. Deterministic, no atomics.
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_kernel(const int32_t* ids, int P, int k, int E, int32_t* offsets, int32_t* rows, int32_t* pos) {
  pdl_trigger();
  pdl_wait();
  __shared__ int warp_n[kSortThreads / 32];
  const int e = blockIdx.x, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, nw = blockDim.x >> 5;
  int below = 0, here = 0;
  for (int base = 0; base < P; base += blockDim.x) {
    const int p = base + tid;
    const int id = p < P ? ids[p] : E;
    below += __syncthreads_count(id < e);
    here += __syncthreads_count(id == e);
  }
  if (tid == 0) {
    offsets[e] = below;
    if (e == E - 1) offsets[E] = below + here;
  }
  if (here == 0) return;  // uniform across the block
  int next = below;
  for (int base = 0; base < P; base += blockDim.x) {
    const int p = base + tid;
    const bool mine = p < P && ids[p] == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_n[wid] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < nw; ++w) {
      const int c = warp_n[w];
      before += w < wid ? c : 0;
      total += c;
    }
    if (mine) {
      const int at = next + before + __popc(ballot & ((1u << lane) - 1u));
      rows[at] = p / k;
      pos[p] = at;
    }
    next += total;
    __syncthreads();  // warp_n is rewritten next round
  }
}

// Switch moe_sort_scan: the same offsets, rows and pos from one block: a histogram of the expert ids in shared memory,
// an exclusive scan (→ offsets), then each pair p = t·k + j takes the next free row of its expert through a
// shared-memory cursor: rows[at] = t, pos[p] = at. The order of an expert's rows then varies from run to run; every
// row is computed on its own (moe_gemm), so no output does.
__global__ void __launch_bounds__(kSortThreads)
    moe_sort_scan_kernel(const int32_t* ids, int P, int k, int E, int32_t* offsets, int32_t* rows, int32_t* pos) {
  pdl_trigger();
  pdl_wait();
  constexpr int kPer = kMaxExperts / 32;
  __shared__ int count[kMaxExperts];
  __shared__ int cursor[kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
  __syncthreads();
  if (threadIdx.x < 32) {  // exclusive scan: lane l owns experts kPer·l .. kPer·l + kPer − 1
    const int lane = threadIdx.x;
    int v[kPer], own = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane * kPer + i;
      v[i] = e < E ? count[e] : 0;
      own += v[i];
    }
    int incl = own;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += u;
    }
    int run = incl - own;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane * kPer + i;
      if (e < E) cursor[e] = offsets[e] = run;
      run += v[i];
    }
    if (lane == 31) offsets[E] = incl;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const int at = atomicAdd(&cursor[ids[p]], 1);
    rows[at] = p / k;
    pos[p] = at;
  }
}

// h = silu(g) ⊙ u for the shared expert (prefill): g, u f32, h bf16, n values.
__global__ void __launch_bounds__(kSwigluThreads)
    moe_swiglu_kernel(const float* g, const float* u, size_t n, bf16* h) {
  pdl_trigger();
  pdl_wait();
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    h[i] = __float2bfloat16(siluf_(g[i]) * u[i]);
}

// out[t, n] = Σ_j ŵ[t, j]·yd[pos[t, j], n] + γ_t·s[t, n]; thread = 8 consecutive n of token blockIdx.y.
__global__ void __launch_bounds__(kCombineThreads)
    moe_combine_kernel(const bf16* yd, const bf16* s, const int32_t* pos, Route r, int H, int k, bf16* out,
                       float* resid) {
  pdl_trigger();
  pdl_wait();
  const int t = blockIdx.y, n = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (n >= H) return;
  float acc[8] = {}, v[8];
  for (int j = 0; j < k; ++j) {
    const size_t row = size_t(pos[size_t(t) * k + j]);
    const float wj = r.wts[size_t(t) * k + j];
    bf16x8_to_f(*reinterpret_cast<const uint4*>(yd + row * H + n), v);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = fmaf(wj, v[i], acc[i]);  // + ŵ_e·y_e
  }
  const float g = r.gamma[t];
  bf16x8_to_f(*reinterpret_cast<const uint4*>(s + size_t(t) * H + n), v);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = fmaf(g, v[i], acc[i]);  // + γ·s
  if (resid) {  // x ← x + MoE(m), fp32
    float4* x4 = reinterpret_cast<float4*>(resid + size_t(t) * H + n);
    const float4 a0 = x4[0], a1 = x4[1];
    x4[0] = make_float4(a0.x + acc[0], a0.y + acc[1], a0.z + acc[2], a0.w + acc[3]);
    x4[1] = make_float4(a1.x + acc[4], a1.y + acc[5], a1.z + acc[6], a1.w + acc[7]);
    return;
  }
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pr = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    o[i] = *reinterpret_cast<const uint32_t*>(&pr);
  }
  *reinterpret_cast<uint4*>(out + size_t(t) * H + n) = make_uint4(o[0], o[1], o[2], o[3]);
}

// ---- kernels: decode ----------------------------------------------------------------------------------------------
// Loads are never predicated: a row past N or a chunk past the row's end reads a clamped, valid address. A chunk
// past the end has x = 0 (so it adds exactly 0); a row past N is computed but not stored.

// Switch route_fused: slot j's expert for token t, from the router logits: the warp runs route_warp's rounds up to
// slot j, the same float operations as the routing kernels, so every warp of every block agrees with the ids block 0
// writes (moe_gate_up_kernel).
__device__ __forceinline__ int routed_expert(const DecodeArgs& a, int t, int j) {
  float p[kMaxExperts / 32];
  load_logits(a.logits + size_t(t) * a.E, a.E, p);
  if (a.pick_logits) return pick_expert(p, j + 1);
  return route_warp<true>(p, a.E, a.k, false, nullptr, nullptr, j + 1);
}

// Block (slot j, tile) of token blockIdx.y; slot j < k is routed expert ids[t, j], slot k the shared expert.
// Switch route_fused: a routed block finds ids[t, j] itself (routed_expert), and block 0 of token t (the shared
// expert's first tile) writes the token's routing (ids, ŵ: warp 0) and γ (warp 1) for moe_down_kernel.
// Lane (row rsub = lane / lpr, sub = lane % lpr) owns chunks c = sub + lpr·i of m (CODES values each, fp32 in
// registers) and of every gate/up row it visits; warp w visits rows n_block + (w·kGuSteps + st)·rpw + rsub, all
// kGuSteps rows' codes loaded before the first is used. h[t, j, n] = silu(gate_n·m) · (up_n·m).
// Switch moe_dp4a (X16): the block stages m once in shared memory as x16 (x16.cuh) and the dot products run on dp4a,
// instead of every lane holding its chunks of m as fp32 in registers.
template <int BITS, bool X16>
__global__ void __launch_bounds__(kGuWarps * 32, 4) moe_gate_up_kernel(const __grid_constant__ DecodeArgs a) {
  constexpr int CODES = 128 / BITS, CPL = kMaxHidden / CODES / 32;  // codes per 16 B; chunks per lane, at most
  constexpr int kXChunks = X16 ? kMaxHidden / CODES : 1;
  __shared__ uint4 xi[kXChunks * kX16Slots<BITS>];
  __shared__ float xsum_s[kXChunks], xd_s[kXChunks];
  // Slot order: the shared expert's blocks first (their weights are known before the routing is), then slots 0..k-1.
  const int t = blockIdx.y, js = blockIdx.x / a.tiles_gu, j = js == 0 ? a.k : js - 1, tile = blockIdx.x % a.tiles_gu;
  const bool shared = j == a.k;
  const int N = shared ? a.IS : a.I, n_block = tile * a.rb_gu;
  pdl_trigger();
  if (n_block >= N) return;  // whole block; no barrier in this kernel
  if (!shared) pdl_wait();  // the routing comes from the previous kernel; the shared expert's codes need none
  const size_t e = shared ? 0 : size_t(a.logits ? routed_expert(a, t, j) : a.ids[t * a.k + j]);
  TracePhases<3> tp;  // the step trace's phases (thread 0): the expert known, h written, then the routing released
  tp.mark(0);         // (the routing block) or the codes in (the others)
  const QStack G = shared ? a.sgate : a.gate, U = shared ? a.sup : a.up;
  const int wpr = a.H * BITS / 32, gpr_g = a.H / G.group, gpr_u = a.H / U.group, chunks = a.H / CODES;
  const uint32_t* gw = G.w + e * N * wpr;
  const uint32_t* uw = U.w + e * N * wpr;
  const uint16_t *gs = G.s + e * N * gpr_g, *gb = G.b + e * N * gpr_g;
  const uint16_t *us = U.s + e * N * gpr_u, *ub = U.b + e * N * gpr_u;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, lpr = a.lpr_gu, rpw = 32 / lpr;
  const int sub = lane & (lpr - 1), rsub = lane / lpr;
  // Issue every load before the first use: the codes, scales and biases, then m's chunks (raw bf16).
  const int n_warp = n_block + warp * kGuSteps<BITS> * rpw + rsub;
  uint4 qg[kGuSteps<BITS>][CPL], qu[kGuSteps<BITS>][CPL];
  uint16_t sg[kGuSteps<BITS>][CPL], bg[kGuSteps<BITS>][CPL], su[kGuSteps<BITS>][CPL], bu[kGuSteps<BITS>][CPL];
#pragma unroll
  for (int st = 0; st < kGuSteps<BITS>; ++st) {
    const size_t n = size_t(min(n_warp + st * rpw, N - 1));
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const int c = min(sub + lpr * i, chunks - 1);
      qg[st][i] = load16(gw + n * wpr + c * 4);
      qu[st][i] = load16(uw + n * wpr + c * 4);
      const int kg = c * CODES / G.group, ku = c * CODES / U.group;
      sg[st][i] = gs[n * gpr_g + kg];
      bg[st][i] = gb[n * gpr_g + kg];
      su[st][i] = us[n * gpr_u + ku];
      bu[st][i] = ub[n * gpr_u + ku];
    }
  }
  if (shared) pdl_wait();  // m comes from the previous kernel
  auto mark_codes = [&] {  // the trace's "codes in", once m's loads are issued
    if (threadIdx.x || (a.logits && blockIdx.x == 0)) return;
    unsigned qx = 0;
#pragma unroll
    for (int st = 0; st < kGuSteps<BITS>; ++st)
#pragma unroll
      for (int i = 0; i < CPL; ++i) qx ^= qg[st][i].x ^ qu[st][i].w ^ sg[st][i] ^ bu[st][i];
    tp.mark_on(2, qx);
  };
  if (a.logits && blockIdx.x == 0 && warp < 2) {  // the token's routing and γ, read by moe_down_kernel
    if (warp == 0) {
      float p[kMaxExperts / 32];
      load_logits(a.logits + size_t(t) * a.E, a.E, p);
      if (a.pick_logits)
        pick_route(p, a.E, a.k, a.norm_topk, a.ids + t * a.k, a.wts + t * a.k);
      else
        route_warp<true>(p, a.E, a.k, a.norm_topk, a.ids + t * a.k, a.wts + t * a.k, a.k);
      if (a.flags) release_routing(a.flags + 2 * t, a.tag);
      tp.mark(2);
    } else {
      const bf16* mt = a.m + size_t(t) * a.H;
      const float gamma = a.seg_bits == 8 ? seg_gate_warp<8>(a.seg, mt, a.H) : seg_gate_warp<4>(a.seg, mt, a.H);
      if (lane == 0) a.gamma[t] = gamma;
    }
  }
  const bf16* mr = a.m + size_t(t) * a.H;
  float* hr = a.h + (size_t(t) * (a.k + 1) + j) * a.hs;
  if constexpr (X16) {
    stage_x16<BITS>(mr, chunks, xi, xsum_s, xd_s);
    __syncthreads();  // n_block ≥ N returned whole blocks only
    mark_codes();
#pragma unroll
    for (int st = 0; st < kGuSteps<BITS>; ++st) {
      float g = 0.0f, u = 0.0f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        const int c = sub + lpr * i;
        if (c >= chunks) continue;
        const uint4* q[2] = {&qg[st][i], &qu[st][i]};
        int tot[2];
        x16_dots<BITS, 2>(xi, c, q, tot);
        const float d = xd_s[c], xsc = xsum_s[c];
        g = fmaf(bf16_bits_to_f(sg[st][i]) * d, float(tot[0]), fmaf(bf16_bits_to_f(bg[st][i]), xsc, g));
        u = fmaf(bf16_bits_to_f(su[st][i]) * d, float(tot[1]), fmaf(bf16_bits_to_f(bu[st][i]), xsc, u));
      }
      g = group_sum(g, lpr);
      u = group_sum(u, lpr);
      const int n = n_warp + st * rpw;
      if (n < N && sub == 0) hr[n] = siluf_(g) * u;  // silu(W_gate·m) ⊙ (W_up·m)
    }
  } else {
    uint4 xr[CPL][CODES / 8];
#pragma unroll
    for (int i = 0; i < CPL; ++i)
#pragma unroll
      for (int v = 0; v < CODES / 8; ++v)
        xr[i][v] = *reinterpret_cast<const uint4*>(mr + min(sub + lpr * i, chunks - 1) * CODES + 8 * v);
    mark_codes();
    float x[CPL][CODES], xs[CPL];
#pragma unroll
    for (int i = 0; i < CPL; ++i) {
      const bool chunk = sub + lpr * i < chunks;
#pragma unroll
      for (int v = 0; v < CODES / 8; ++v) bf16x8_to_f(chunk ? xr[i][v] : make_uint4(0, 0, 0, 0), &x[i][8 * v]);
      xs[i] = 0.0f;
#pragma unroll
      for (int q = 0; q < CODES; ++q) xs[i] += x[i][q];
    }
#pragma unroll
    for (int st = 0; st < kGuSteps<BITS>; ++st) {
      float g = 0.0f, u = 0.0f;
#pragma unroll
      for (int i = 0; i < CPL; ++i) {
        g += chunk_dot<BITS>(qg[st][i], x[i], xs[i], bf16_bits_to_f(sg[st][i]), bf16_bits_to_f(bg[st][i]));
        u += chunk_dot<BITS>(qu[st][i], x[i], xs[i], bf16_bits_to_f(su[st][i]), bf16_bits_to_f(bu[st][i]));
      }
      g = group_sum(g, lpr);
      u = group_sum(u, lpr);
      const int n = n_warp + st * rpw;
      if (n < N && sub == 0) hr[n] = siluf_(g) * u;  // silu(W_gate·m) ⊙ (W_up·m)
    }
  }
  if (threadIdx.x == 0) {
    tp.mark(1);
    tp.record(a.logits && blockIdx.x == 0 ? 20 : shared ? 24 : 28);
  }
}

// Block = rb_down output rows n0.. of token blockIdx.y; warp j = slot j (j < k: W_down[ids[t, j]] with weight
// ŵ[t, j]; j = k: W_sd with weight γ_t). Lane (rsub = lane / lpr, c = lane % lpr) holds chunk c of h[t, j] and
// dots it with chunk c of rows n0 + r + rsub, kDownSteps rows per batch, all loaded first; the weighted partials
// meet in shared memory and are summed in slot order.
// EARLY (switch moe_down_early): the routed warps take the ids once the routing block has released them
// (await_routing, by warp 0's lane 0, then a barrier of the k routed warps) and load their first codes before the PDL
// wait, as the shared warp does, instead of after it.
template <int BITS, bool EARLY>
__global__ void __maxnreg__(96) moe_down_kernel(const __grid_constant__ DecodeArgs a) {
  constexpr int CODES = 128 / BITS;
  extern __shared__ float part[];  // [k+1][rb_down]
  const int t = blockIdx.y, n0 = blockIdx.x * a.rb_down, rb = a.rb_down;
  const int j = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool shared = j == a.k;
  const int K = shared ? a.IS : a.I;
  const QStack D = shared ? a.sdown : a.down;
  pdl_trigger();
  TracePhases<6> tp;  // the step trace's phases (thread 0): ids out, wait passed, h in, codes in, dots done, x written
  if constexpr (EARLY) {
    if (!shared) {
      if (j == 0 && lane == 0) await_routing(a.flags + 2 * t, a.tag);
      __syncwarp();
      asm volatile("bar.sync 1, %0;" ::"r"(32 * a.k) : "memory");  // the routed warps
    }
  } else if (!shared) {
    pdl_wait();  // the routing comes from an earlier kernel; the shared expert's codes need none
  }
  tp.mark(0);
  const size_t e = shared ? 0 : size_t(EARLY ? __ldcg(a.ids + t * a.k + j) : a.ids[t * a.k + j]);
  const int chunks = K / CODES, wpr = K * BITS / 32, gpr = K / D.group;
  int lpr = 1;
  while (lpr < chunks) lpr <<= 1;  // chunks ≤ 32
  const int rpw = 32 / lpr, c = lane & (lpr - 1), rsub = lane / lpr, cc = min(c, chunks - 1);
  const uint32_t* w = D.w + e * a.H * wpr + cc * 4;
  const int kg = cc * CODES / D.group;
  const uint16_t *ds = D.s + e * a.H * gpr + kg, *db = D.b + e * a.H * gpr + kg;

  uint4 q[kDownSteps];
  uint16_t s[kDownSteps], b[kDownSteps];
  auto load_rows = [&](int r0) {  // the codes of rows n0 + r0 + st·rpw + rsub
#pragma unroll
    for (int st = 0; st < kDownSteps; ++st) {
      const size_t n = size_t(min(n0 + r0 + st * rpw + rsub, a.H - 1));
      q[st] = load16(w + n * wpr);
      s[st] = ds[n * gpr];
      b[st] = db[n * gpr];
    }
  };
  load_rows(0);
  if (EARLY && j == 0 && lane == 0) count_block(a.flags + 2 * t, gridDim.x);
  if (EARLY || shared) pdl_wait();  // h, ŵ and γ come from earlier kernels
  tp.mark(1);

  // x: chunk c of h[t, j] (0 past the row's end); xs = Σ x computed after the codes are in flight.
  const float wj = shared ? a.gamma[t] : a.wts[t * a.k + j];
  float x[CODES];
  unsigned dv = 0;  // the dots, for the trace's mark
  const float* hr = a.h + (size_t(t) * (a.k + 1) + j) * a.hs + cc * CODES;
#pragma unroll
  for (int v = 0; v < CODES / 4; ++v) {
    const float4 f = *reinterpret_cast<const float4*>(hr + 4 * v);
    x[4 * v] = f.x;
    x[4 * v + 1] = f.y;
    x[4 * v + 2] = f.z;
    x[4 * v + 3] = f.w;
  }

  for (int r0 = 0; r0 < rb; r0 += kDownSteps * rpw) {  // rb is a multiple of kDownSteps·rpw
    if (r0) load_rows(r0);
    float xs = 0.0f;
#pragma unroll
    for (int i = 0; i < CODES; ++i) {
      if (c >= chunks) x[i] = 0.0f;
      xs += x[i];
    }
    if (r0 == 0) {  // the trace's "h in", then "codes in"
      unsigned qx = 0;
#pragma unroll
      for (int st = 0; st < kDownSteps; ++st) qx ^= q[st].x ^ q[st].y ^ q[st].z ^ q[st].w ^ s[st] ^ b[st];
      tp.mark_on(2, __float_as_uint(xs) ^ __float_as_uint(wj));
      tp.mark_on(3, qx);
    }
#pragma unroll
    for (int st = 0; st < kDownSteps; ++st) {
      const float v = group_sum(chunk_dot<BITS>(q[st], x, xs, bf16_bits_to_f(s[st]), bf16_bits_to_f(b[st])), lpr);
      if (c == 0) part[j * rb + r0 + st * rpw + rsub] = wj * v;  // ŵ_e·y_e[n] or γ·s[n]
      dv ^= __float_as_uint(v);
    }
  }
  tp.mark_on(4, dv);
  __syncthreads();
  for (int r = threadIdx.x; r < rb; r += blockDim.x) {
    const int n = n0 + r;
    if (n >= a.H) break;
    float acc = 0.0f;
    for (int jj = 0; jj <= a.k; ++jj) acc += part[jj * rb + r];
    const size_t o = size_t(t) * a.H + n;
    if (a.resid)
      a.resid[o] += acc;  // x ← x + MoE(m)
    else
      a.out[o] = __float2bfloat16(acc);
  }
  if (threadIdx.x == 0) {
    tp.mark(5);
    tp.record(EARLY ? 32 : 40);
  }
}

// ---- launcher helpers ---------------------------------------------------------------------------------------------

// Whether the decode kernels take these shapes: a row of K codes splits into 16-byte chunks that stay in one group.
bool chunks_fit(const QMatrix& q, int bits, int max_chunks) {
  const int codes = 128 / bits;
  return q.bits == bits && q.K % codes == 0 && q.K / codes <= max_chunks && q.group % codes == 0 && aligned(q.w, 16);
}

bool decode_fits(const MoeArgs& a, const MoeWeights& w) {
  const int gb = w.gate.bits, db = w.down.bits;
  const int gu_max = kMaxHidden * gb / 128;  // chunks of a row of H the registers hold (CPL · 32)
  return a.top_k + 1 <= kDownMaxWarps && chunks_fit(w.gate, gb, gu_max) && chunks_fit(w.up, gb, gu_max) &&
         chunks_fit(w.shared_gate, gb, gu_max) && chunks_fit(w.shared_up, gb, gu_max) && chunks_fit(w.down, db, 32) &&
         chunks_fit(w.shared_down, db, 32);
}

// logits: the router's, for the routing in the gate+up kernel (switch route_fused), or null after a routing kernel.
void moe_decode(Ctx& ctx, const MoeArgs& a, const MoeWeights& w, const bf16* m, const Route& r, const float* logits,
                bf16* out, float* resid) {
  DecodeArgs d{};
  d.logits = logits;
  d.seg = stack_of(w.shared_expert_gate);
  d.seg_bits = w.shared_expert_gate.bits;
  d.E = a.E;
  d.norm_topk = a.norm_topk_prob;
  d.pick_logits = ctx.opts.on(Opt::route_logits);
  const bool early = logits && ctx.opts.on(Opt::moe_down_early);
  if (early) {
    d.flags = ctx.moe_flags;
    d.tag = ++ctx.moe_tag ? ctx.moe_tag : ++ctx.moe_tag;  // never 0, the cleared flag
  }
  d.resid = resid;
  d.gate = stack_of(w.gate), d.up = stack_of(w.up), d.down = stack_of(w.down);
  d.sgate = stack_of(w.shared_gate), d.sup = stack_of(w.shared_up), d.sdown = stack_of(w.shared_down);
  d.m = m, d.ids = r.ids, d.wts = r.wts, d.gamma = r.gamma, d.out = out;
  d.T = a.T, d.H = a.H, d.k = a.top_k, d.I = a.I, d.IS = a.IS, d.hs = std::max(a.I, a.IS);
  d.h = static_cast<float*>(ctx.scratch(kSlotMoeHidden, size_t(a.T) * (a.top_k + 1) * d.hs * sizeof(float)));

  dispatch_bits(w.gate.bits, [&](auto bits) {
    constexpr int BITS = decltype(bits)::value;
    const int chunks = a.H * BITS / 128;
    d.lpr_gu = chunks >= 32 ? 32 : pow2_at_least(chunks);
    d.rb_gu = kGuWarps * kGuSteps<BITS> * (32 / d.lpr_gu);
    d.tiles_gu = int(cdiv(d.hs, d.rb_gu));
    const dim3 grid(unsigned((a.top_k + 1) * d.tiles_gu), unsigned(a.T));
    launch(ctx, ctx.opts.on(Opt::moe_dp4a) ? moe_gate_up_kernel<BITS, true> : moe_gate_up_kernel<BITS, false>, grid,
           kGuWarps * 32, 0, d);
  });
  check_launch("moe_gate_up_kernel");

  dispatch_bits(w.down.bits, [&](auto bits) {
    constexpr int BITS = decltype(bits)::value;
    const int rpw = 32 / std::min(pow2_at_least(a.I * BITS / 128), pow2_at_least(a.IS * BITS / 128));
    d.rb_down = kDownSteps * rpw;  // a multiple of both slots' rows per warp step
    const dim3 grid(unsigned(cdiv(a.H, d.rb_down)), unsigned(a.T));
    const size_t smem = size_t(a.top_k + 1) * d.rb_down * sizeof(float);
    launch(ctx, early ? moe_down_kernel<BITS, true> : moe_down_kernel<BITS, false>, grid, 32 * (a.top_k + 1), smem,
           d);
  });
  check_launch("moe_down_kernel");
}

// The shared expert's scratch, taken on the main stream (the side stream allocates none).
struct Shared {
  float *g, *u;
  bf16 *h, *s;
};
Shared shared_at(Ctx& ctx, const MoeArgs& a) {
  const Parts<4> shp = moe_shared_parts(a.T, a.IS, a.H);
  void* shb = ctx.scratch(kSlotMoeShared, shp.bytes);
  return {shp.at<float>(shb, kSharedG), shp.at<float>(shb, kSharedU), shp.at<bf16>(shb, kSharedH),
          shp.at<bf16>(shb, kSharedS)};
}

// s = W_sd·(silu(W_sg·m) ⊙ (W_su·m)) for a prefill chunk: three GEMMs and the SwiGLU between them.
void moe_shared(Ctx& ctx, const MoeArgs& a, const MoeWeights& w, const bf16* m, const Shared& sh) {
  qmm(ctx, w.shared_gate, m, a.T, sh.g, true);
  qmm(ctx, w.shared_up, m, a.T, sh.u, true);
  const size_t n = size_t(a.T) * a.IS;
  const int blocks = int(std::min<size_t>(cdiv(n, kSwigluThreads), size_t(ctx.num_sms) * 8));
  launch(ctx, moe_swiglu_kernel, blocks, kSwigluThreads, 0, sh.g, sh.u, n, sh.h);
  check_launch("moe_swiglu_kernel");
  qmm(ctx, w.shared_down, sh.h, a.T, sh.s, false);
}

// The routed experts of a prefill chunk and the combine; the shared expert runs here unless it already runs on the
// side stream (on_side: joined before the combine).
void moe_prefill(Ctx& ctx, const MoeArgs& a, const MoeWeights& w, const bf16* m, const Route& r, const Shared& sh,
                 bool on_side, bf16* out, float* resid) {
  const int T = a.T, k = a.top_k, E = a.E, H = a.H, I = a.I, P = T * k;

  const Parts<5> sp = moe_sort_parts(E, P, 0);
  const MoeSort sort = moe_sort_at(ctx.scratch(kSlotMoeSort, sp.bytes), sp);
  int32_t *offsets = sort.offsets, *rows = sort.rows, *pos = sort.pos;
  if (ctx.opts.on(Opt::moe_sort_scan))
    launch(ctx, moe_sort_scan_kernel, 1, kSortThreads, 0, r.ids, P, k, E, offsets, rows, pos);
  else
    launch(ctx, moe_sort_kernel, E, kSortThreads, 0, r.ids, P, k, E, offsets, rows, pos);
  check_launch("moe_sort");

  bf16* h = static_cast<bf16*>(ctx.scratch(kSlotMoeHidden, size_t(P) * I * sizeof(bf16)));
  bf16* yd = static_cast<bf16*>(ctx.scratch(kSlotMoeOut, size_t(P) * H * sizeof(bf16)));
  moe_gemm(ctx, w.gate, &w.up, offsets, rows, P, T, m, h);       // h = silu(m·W_gateᵀ) ⊙ (m·W_upᵀ), sorted rows
  moe_gemm(ctx, w.down, nullptr, offsets, nullptr, P, T, h, yd);  // yd = h·W_downᵀ, same sorted rows

  if (on_side)
    join_side(ctx);
  else
    moe_shared(ctx, a, w, m, sh);
  const dim3 grid(unsigned(cdiv(H / 8, kCombineThreads)), unsigned(T));
  launch(ctx, moe_combine_kernel, grid, kCombineThreads, 0, yd, sh.s, pos, r, H, k, out, resid);
  check_launch("moe_combine_kernel");
}

}  // namespace

// ---- launcher -----------------------------------------------------------------------------------------------------

namespace {

void check_moe_args(const MoeArgs& a, const MoeWeights& w, const bf16* m, const bf16* out) {
  for (const MoeMatrix& mm : check_moe(a, w, m, out))  // backend/checks.h's rules; then this file's
    LILY_CHECK(mm.q.group > 0 && mm.q.group % (32 / mm.q.bits) == 0 && mm.K % mm.q.group == 0, "moe: ", mm.name,
               " has group=", mm.q.group, ", which must divide K=", mm.K, " and be a multiple of ", 32 / mm.q.bits);
  LILY_CHECK(int64_t(a.T) * a.top_k * std::max(a.H, std::max(a.I, a.IS)) < (int64_t(1) << 31),
             "moe: T·top_k·max(H, I, IS) must stay below 2^31");
}

// Switch norm_fold: the MoE's m = rms_norm(x.x)·x.w is not computed yet: the router folds the norm and writes m.
struct Fold {
  NormParts x;
  float eps;
  bf16* m;
};

// The MoE block on m; the result goes to out, or is added to resid (fp32). fold: m from the router (above).
void run_moe(Ctx& ctx, const MoeArgs& a, const MoeWeights& w, const bf16* m, bf16* out, float* resid,
             const Fold* fold = nullptr) {
  float* logits = static_cast<float*>(ctx.scratch(kSlotMoeLogits, size_t(a.T) * a.E * sizeof(float)));
  const Parts<3> rp = moe_route_parts(a.T, a.top_k);
  const Route r = moe_route_at(ctx.scratch(kSlotMoeRoute, rp.bytes), rp);
  const bool decode = a.T <= kMoeDecodeMaxT && decode_fits(a, w);
  // A prefill chunk's shared expert needs only m: under moe_shared_stream it runs on the side stream while the
  // router, the routing, the sort (one block) and the routed GEMMs run here, filling the SMs they leave idle.
  const bool on_side = !decode && ctx.opts.on(Opt::moe_shared_stream);
  Shared sh{};
  if (!decode) sh = shared_at(ctx, a);
  if (on_side) {
    Ctx side = fork_side(ctx);
    moe_shared(side, a, w, m, sh);
  }

  void* const lg = logits;
  if (!fold || !qmv_fold(ctx, &w.router, 1, fold->x, fold->eps, &lg, true, fold->m)) {
    if (fold) rms_norm(ctx, fold->x.x, fold->x.w, 1, a.H, fold->eps, fold->m);
    qmm(ctx, w.router, m, a.T, logits, true);  // ℓ = m·W_routerᵀ (f32)
  }
  if (decode && ctx.opts.on(Opt::route_fused)) {  // the routing runs inside the gate+up kernel
    moe_decode(ctx, a, w, m, r, logits, out, resid);
    return;
  }
  dispatch_bits(w.shared_expert_gate.bits, [&](auto bits) {
    constexpr int SB = decltype(bits)::value;
    launch(ctx, moe_route_kernel<SB>, unsigned(cdiv(a.T, kRouteWarps)), kRouteWarps * 32, 0, logits, m,
           stack_of(w.shared_expert_gate), a.T, a.E, a.top_k, a.H, a.norm_topk_prob, r);
  });
  check_launch("moe_route_kernel");

  if (decode)
    moe_decode(ctx, a, w, m, r, nullptr, out, resid);
  else
    moe_prefill(ctx, a, w, m, r, sh, on_side, out, resid);
}

}  // namespace

void moe(Ctx& ctx, const MoeArgs& a, const MoeWeights& w, const bf16* m, bf16* out) {
  check_moe_args(a, w, m, out);
  if (a.T == 0) return;
  run_moe(ctx, a, w, m, out, nullptr);
}

void moe_residual(Ctx& ctx, float* x, const QMatrix& W_o, const bf16* y, const float* nw, float eps, const MoeArgs& a,
                  const MoeWeights& w, bf16* m, bf16* out) {
  check_moe_args(a, w, m, out);
  LILY_CHECK(W_o.N == a.H, "moe_residual: the output projection has ", W_o.N, " rows, not H=", a.H);
  if (a.T == 0) return;
  LILY_CHECK(aligned(x, 16), "moe_residual: x must be 16-byte aligned");
  if (a.T == 1 && ctx.opts.on(Opt::norm_fold)) {
    const Parts<2> np = norm_parts(kNormMaxParts, a.H);
    void* buf = ctx.scratch(kSlotNormParts, np.bytes);
    // x ← x + y·W_oᵀ, with x ⊙ nw and Σx² by block for the router
    const NormParts post = qmv_residual(ctx, W_o, y, x, nw, np.at<bf16>(buf, kNormXw), np.at<float>(buf, kNormParts));
    if (post.n) {
      const Fold fold{post, eps, m};
      run_moe(ctx, a, w, m, out, x, &fold);  // m by the router; x ← x + MoE(m), added by the last kernel
      return;
    }
  }
  qmm(ctx, W_o, y, a.T, out, false);              // d = y·W_oᵀ
  add_rms_norm(ctx, x, out, nw, a.T, a.H, eps, m);  // x ← x + d;  m = rms_norm(x)·nw
  run_moe(ctx, a, w, m, out, x);                    // x ← x + MoE(m), added by the last kernel
}

}  // namespace lily::cuda
