// sample.cu: token selection on the GPU, so a decode step never waits for the host (core/sample.h is the rule
// book and the host reference; both kernels follow it step for step).
//
// Math     x_i = raw_i with penalties (repetition on seen ids, frequency/presence on generated ids), / temperature;
//          T = 0: argmax x (lowest id on ties). Else keep x_i ≥ k-th largest x (top-k, ties kept), then top-p
//          (keep i iff Σ_{x_j > x_i} w_j < top_p·Σ w, w = exp(x − x_max)), then min-p (w_i ≥ min_p); draw
//          u = to_unit_double(splitmix64(seed ^ step·φ)) and take the first kept id (ascending) whose running Σ w
//          exceeds u·Σ w. logprob = raw_token − logsumexp(raw) over [0, n_valid).
// Mapping  one block of 1024 threads: two coalesced passes over the logits (max/argmax, then Σexp), four radix
//          passes (8 bits each) for the k-th largest, one ordered compaction of the ≤ kSampleMaxCand candidates
//          into shared memory, then O(n²) top-p masses over the candidates and a serial draw by thread 0.
//          Switch sample_cluster (n ≤ 262,144): a cluster of 16 blocks, each id read once into a register of one
//          thread; the same steps on the registers, the blocks' maxima, sums, radix histograms and candidate counts
//          met through distributed shared memory (up to 7 cluster barriers when sampling, 2 when greedy: the radix
//          rounds stop once the picked bin lies wholly in the top-k), the candidates written in id order into block
//          0, which draws (sample_cluster_kernel, below).
// Traffic  n = 248,077 valid ids (the real tokenizer): the fp32 logits and int32 counts read ~7 times from L2 by one
//          SM, 681–690 µs per selection on the H100 (ncu); the cluster reads them once over 16 SMs, 34–36 µs
//          (benchmarks/NOTES.md, session 37). Versus the host path: the 1 MB copy and a 1.3 ms host pass per token.
// Checks   the host calls sample() only when can_sample() (backend/policy.h: device_can_sample): greedy, or the
//          top-k set fits kSampleMaxCand, and top_logprobs == 0. Ties at the top-k boundary beyond kSampleMaxCand
//          keep the lowest ids (host path keeps all).
// Ref      core/sample.cpp · Test tests/test_cuda.py (each kernel vs the host sampler in the decode loop, and both on
//          device_sampling.DIRECT: ties within and beyond the candidates, ragged slices, the real vocabulary)
// History  v1 · v2 (2026-12-05) sample_cluster: decode +52 % / +46 % at 4K / 32K on the H100 with the real vocabulary
//          (the benchmarks before it timed 489 ids). Tried and dropped: warp-aggregated histogram adds
//          (__match_any_sync), level on the model and slower in ncu.
//          v3 (2026-12-06) the generation counts read only when a frequency or presence penalty is set (the host
//          sampler's rule): greedy 13.4 → 10.7 µs, top-k 20 / top-p 0.95 ~31.5 → ~28.5 µs (ncu, H100).
//          v4 (2026-12-06) the draw counter read before the PDL wait, the count and the position advanced by
//          reductions. Tried and removed (benchmarks/NOTES.md, session 47): Metal's sample_split on CUDA (122
//          blocks of 2048 ids, then one merging block), +0.23 % / +0.27 % at 4K / 32K on the H100.
#include <cfloat>

#include <cooperative_groups.h>

#include "backend/cuda/ops.cuh"

namespace lily::cuda {

constexpr int kSampleThreads = 1024;
// sample_cluster: a cluster of kClusterBlocks blocks, each id in a register of one thread (at most kClusterPer ids a
// thread: 16 keeps the kernel in 64 registers without spills), so n_valid ≤ kClusterMaxN.
constexpr int kClusterBlocks = 16;
constexpr int kClusterPer = 16;
constexpr int kClusterMaxN = kClusterBlocks * kSampleThreads * kClusterPer;  // 262,144 ≥ the real 248,320

struct SampleKernelArgs {
  SamplingParams p;
  int n_valid;
  const float* logits;
  DeviceSampler st;
};

// x_i of id i from its raw logit (penalties, then temperature).
__device__ __forceinline__ float processed(const SampleKernelArgs& a, int i, float raw) {
  float x = raw;
  if (a.p.repetition_penalty != 1.0f && a.st.seen[i]) x = x > 0 ? x / a.p.repetition_penalty : x * a.p.repetition_penalty;
  if (a.p.frequency_penalty != 0.0f || a.p.presence_penalty != 0.0f) {  // else x − 0 = x: no count is read
    const int c = a.st.counts[i];
    if (c > 0) x -= a.p.frequency_penalty * float(c) + a.p.presence_penalty;
  }
  if (a.p.temperature > 0) x /= a.p.temperature;
  return x;
}
__device__ __forceinline__ float processed(const SampleKernelArgs& a, int i) { return processed(a, i, a.logits[i]); }

// Order-preserving map of a float to uint32 (larger float → larger key), and back.
__device__ __forceinline__ uint32_t fkey(float f) {
  uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float unkey(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

__device__ __forceinline__ uint64_t splitmix64_d(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// (x, id) pairs ordered by x, the lower id first among equal x.
__device__ __forceinline__ void argmax_merge(float& x, int& i, float ox, int oi) {
  if (ox > x || (ox == x && oi < i)) x = ox, i = oi;
}

// One radix round's pick: hist holds the counts of the keys matching the prefix so far, by their next 8 bits at
// `shift`; the k-th largest lies in the highest bin b with ≥ need keys at or above it. Thread 0.
__device__ __forceinline__ void radix_pick(const uint32_t* hist, int shift, int* need, uint32_t* prefix) {
  int nd = *need, b = 255;
  while (b > 0 && int(hist[b]) < nd) nd -= hist[b--];
  *need = nd;
  *prefix |= uint32_t(b) << shift;
}

// radix_pick by one warp: lane l holds bins 8l .. 8l+7, a suffix sum over the lanes finds the lane whose bins hold
// the need-th key from the top, and that lane walks its eight bins as the serial loop would. *whole: every key of the
// picked bin is needed, so the k-th largest is the bin's smallest and {key ≥ prefix} (the lower bits zero) is already
// the top-k set the remaining rounds would find.
__device__ __forceinline__ void radix_pick_warp(const uint32_t* hist, int shift, int* need, uint32_t* prefix,
                                                int* whole) {
  const int lane = threadIdx.x & 31, nd = *need;
  int c[8], own = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) c[i] = int(hist[8 * lane + i]), own += c[i];
  int incl = own;  // keys in the bins of lanes ≥ this one
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_down_sync(~0u, incl, o);
    if (lane + o < 32) incl += y;
  }
  int above = incl - own;  // keys in the bins above this lane's
  const unsigned hit = __ballot_sync(~0u, above < nd && incl >= nd);
  if (lane != (hit ? __ffs(hit) - 1 : 0)) return;  // no lane: the loop's end at bin 0
  int b = 8 * lane + 7, in_bin = 0;
#pragma unroll
  for (int i = 7; i >= 0; --i) {
    b = 8 * lane + i, in_bin = c[i];
    if (b == 0 || above + c[i] >= nd) break;
    above += c[i];
  }
  *need = nd - above;
  *prefix |= uint32_t(b) << shift;
  *whole = above + in_bin == nd;
}

// Steps 5 and 6 of the header, by one block on its nc ≤ kSampleMaxCand candidates (ascending ids, processed x):
// weights, top-p, min-p and the draw. Returns the token to thread 0 (x_arg when nothing is kept).
// `step` is *a.st.step, read by thread 0 (the only one that uses it) before the kernel's PDL wait (only the selection
// kernels write it, a step earlier).
__device__ int draw_candidates(const SampleKernelArgs& a, uint64_t step, int nc, float x_max, int x_arg,
                               const int* cand_id, const float* cand_x, double* cand_w, unsigned char* cand_keep,
                               double* s_total) {
  const int tid = threadIdx.x;
  for (int j = tid; j < nc; j += blockDim.x) {
    cand_w[j] = double(expf(cand_x[j] - x_max));
    cand_keep[j] = 1;
  }
  __syncthreads();
  // top-p: keep j iff the mass strictly above it is < top_p·total.
  if (a.p.top_p < 1.0f) {
    if (tid == 0) {
      double total = 0;
      for (int j = 0; j < nc; ++j) total += cand_w[j];
      *s_total = total;
    }
    __syncthreads();
    const double target = double(a.p.top_p) * *s_total;
    for (int j = tid; j < nc; j += blockDim.x) {
      double above = 0;
      for (int m = 0; m < nc; ++m) above += cand_x[m] > cand_x[j] ? cand_w[m] : 0.0;
      cand_keep[j] = above < target;
    }
    __syncthreads();
  }
  // min-p, then the draw over the kept candidates in ascending id order.
  if (tid != 0) return -1;
  double total = 0;
  for (int j = 0; j < nc; ++j) {
    cand_keep[j] = cand_keep[j] && cand_w[j] >= double(a.p.min_p);
    if (cand_keep[j]) total += cand_w[j];
  }
  const double u = double(splitmix64_d(a.p.seed ^ (step * 0x9E3779B97F4A7C15ull)) >> 11) * 0x1.0p-53;
  const double target = u * total;
  double cum = 0;
  int pick = -1;
  for (int j = 0; j < nc; ++j) {
    if (!cand_keep[j]) continue;
    pick = j;
    if ((cum += cand_w[j]) > target) break;
  }
  return pick >= 0 ? cand_id[pick] : x_arg;
}

// The chosen token t recorded (thread 0 of one block): the next step's input, its result slot (token, logprob), the
// penalty state, the draw counter (`step`, read before the wait) and the device position. The count and the position
// advance by reductions, which return nothing, so the thread does not wait on their reads.
__device__ void record_token(const SampleKernelArgs& a, uint64_t step, int t, double lse) {
  *a.st.token = t;
  int32_t* r = a.st.results + 2 * int(step % kResultSlots);
  r[0] = t;
  r[1] = __float_as_int(float(double(a.logits[t]) - lse));
  atomicAdd(&a.st.counts[t], 1);
  a.st.seen[t] = 1;
  *a.st.step = step + 1;
  if (a.st.pos) atomicAdd(a.st.pos, 1);
}

__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const SampleKernelArgs a) {
  pdl_trigger();
  const uint64_t step = threadIdx.x == 0 ? *a.st.step : 0;  // thread 0 alone draws and records
  pdl_wait();
  __shared__ float s_f[32];
  __shared__ int s_i[32];
  __shared__ double s_d[32];
  __shared__ uint32_t hist[256];
  __shared__ int cand_id[kSampleMaxCand];
  __shared__ float cand_x[kSampleMaxCand];
  __shared__ double cand_w[kSampleMaxCand];
  __shared__ unsigned char cand_keep[kSampleMaxCand];
  __shared__ int s_scan[kSampleThreads];
  __shared__ int s_token, s_ncand;
  __shared__ uint32_t s_prefix;
  __shared__ int s_need;
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, n = a.n_valid;

  // 1. raw max, processed max and argmax (lowest id among equal maxima).
  float raw_max = -FLT_MAX, x_max = -FLT_MAX;
  int x_arg = n;
  for (int i = tid; i < n; i += kSampleThreads) {
    raw_max = fmaxf(raw_max, a.logits[i]);
    argmax_merge(x_max, x_arg, processed(a, i), i);
  }
  for (int o = 16; o > 0; o >>= 1) {
    raw_max = fmaxf(raw_max, __shfl_xor_sync(~0u, raw_max, o));
    argmax_merge(x_max, x_arg, __shfl_xor_sync(~0u, x_max, o), __shfl_xor_sync(~0u, x_arg, o));
  }
  if (lane == 0) s_f[wid] = raw_max;
  __syncthreads();
  raw_max = s_f[lane];
  for (int o = 16; o > 0; o >>= 1) raw_max = fmaxf(raw_max, __shfl_xor_sync(~0u, raw_max, o));
  __syncthreads();
  if (lane == 0) s_f[wid] = x_max, s_i[wid] = x_arg;
  __syncthreads();
  x_max = s_f[lane], x_arg = s_i[lane];
  for (int o = 16; o > 0; o >>= 1)
    argmax_merge(x_max, x_arg, __shfl_xor_sync(~0u, x_max, o), __shfl_xor_sync(~0u, x_arg, o));

  // 2. log-sum-exp of the raw logits (for the logprob).
  double sum = 0.0;
  for (int i = tid; i < n; i += kSampleThreads) sum += exp(double(a.logits[i] - raw_max));
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(~0u, sum, o);
  __syncthreads();
  if (lane == 0) s_d[wid] = sum;
  __syncthreads();
  sum = s_d[lane];
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(~0u, sum, o);
  const double lse = double(raw_max) + log(sum);

  if (a.p.temperature == 0.0f) {
    if (tid == 0) s_token = x_arg;
  } else {
    // 3. the k-th largest processed logit, by radix selection on order-preserving keys.
    const int k = (a.p.top_k > 0 && a.p.top_k < n) ? a.p.top_k : n;
    uint32_t prefix = 0;
    if (k < n) {
      if (tid == 0) s_need = k, s_prefix = 0;
      for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += kSampleThreads) hist[b] = 0;
        __syncthreads();
        const uint32_t pre = s_prefix, mask_hi = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
        for (int i = tid; i < n; i += kSampleThreads) {
          const uint32_t key = fkey(processed(a, i));
          if ((key & mask_hi) == (pre & mask_hi)) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) radix_pick(hist, shift, &s_need, &s_prefix);
        __syncthreads();
      }
      prefix = s_prefix;  // the key of the k-th largest x
    }
    // 4. compaction of {i : key(x_i) ≥ prefix} in ascending id order: each thread owns a contiguous id range.
    const int per = (n + kSampleThreads - 1) / kSampleThreads, lo = min(n, tid * per), hi = min(n, lo + per);
    int mine = 0;
    for (int i = lo; i < hi; ++i) mine += fkey(processed(a, i)) >= prefix;
    s_scan[tid] = mine;
    __syncthreads();
    for (int off = 1; off < kSampleThreads; off <<= 1) {  // inclusive Hillis-Steele scan
      const int v = tid >= off ? s_scan[tid - off] : 0;
      __syncthreads();
      s_scan[tid] += v;
      __syncthreads();
    }
    int at = s_scan[tid] - mine;
    for (int i = lo; i < hi; ++i) {
      const float x = processed(a, i);
      if (fkey(x) >= prefix) {
        if (at < kSampleMaxCand) cand_id[at] = i, cand_x[at] = x;
        ++at;
      }
    }
    if (tid == kSampleThreads - 1) s_ncand = min(s_scan[tid], kSampleMaxCand);
    __syncthreads();
    // 5, 6. top-p, min-p, the draw.
    const int t = draw_candidates(a, step, s_ncand, x_max, x_arg, cand_id, cand_x, cand_w, cand_keep, &s_d[0]);
    if (tid == 0) s_token = t;
  }
  __syncthreads();
  if (tid == 0) record_token(a, step, s_token, lse);
}

// ---- sample_cluster: the same selection by a cluster of blocks, every id read once ---------------------------------
// Block r of the cluster holds ids r·1024·per + j·1024 + tid (j < per = ⌈n / 16384⌉ ≤ 16) in registers, as raw
// logits and then as keys of their processed x, so the block's 1024 threads read each row of 1024 ids coalesced and
// ascending ids run in (block, j, thread) order. The block results meet through distributed shared memory after a
// cluster barrier: the raw max with Σexp and the argmax (merged by block 0 alone); each radix round's 256-bin
// histogram (double-buffered, so that one barrier a round suffices); the blocks' candidate counts, after which every
// block writes its candidates, in order, into block 0's arrays; block 0 alone goes on with steps 5 and 6. Every block
// makes each decision itself from the same sums, so they agree without a broadcast.

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// Address of the same shared variable in block `rank` of the cluster.
template <typename T>
__device__ __forceinline__ T* in_block(T* p, unsigned rank) {
  return static_cast<T*>(cooperative_groups::this_cluster().map_shared_rank(p, rank));
}

__global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kSampleThreads, 1)
    sample_cluster_kernel(const SampleKernelArgs a) {
  pdl_trigger();
  const uint64_t step = threadIdx.x == 0 ? *a.st.step : 0;  // thread 0 alone draws and records
  pdl_wait();
  __shared__ float s_f[32];
  __shared__ int s_i[32];
  __shared__ double s_d[32];
  __shared__ float s_x[32];
  __shared__ float b_raw_max, b_x_max;
  __shared__ int b_x_arg, b_count;
  __shared__ double b_sum, s_lse;
  __shared__ uint32_t hist[2][256], tot[256];
  __shared__ int s_need, s_whole;
  __shared__ uint32_t s_prefix;
  __shared__ int s_rows[32][32];  // candidates per (row j, warp), then their exclusive prefix in (j, warp) order
  __shared__ int cand_id[kSampleMaxCand];
  __shared__ float cand_x[kSampleMaxCand];
  __shared__ double cand_w[kSampleMaxCand];
  __shared__ unsigned char cand_keep[kSampleMaxCand];
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, n = a.n_valid;
  const unsigned rank = cooperative_groups::this_cluster().block_rank();
  const int per = (n + kClusterBlocks * kSampleThreads - 1) / (kClusterBlocks * kSampleThreads);
  const int base = int(rank) * kSampleThreads * per + tid;  // id of row j: base + j·1024
  auto id_of = [&](int j) { return base + j * kSampleThreads; };
  auto live = [&](int j) { return j < per && id_of(j) < n; };

  // 1, 2. the raw logits into registers; the block's raw max m and Σ exp(raw − m) (fp32 terms, ≤ 1 ulp from the
  // one-block kernel's fp64 ones, summed in fp64); the processed x as keys, and the argmax. Block 0's thread 0 merges
  // the blocks' (m, Σ) and argmaxes into the logprob's log-sum-exp and the token of greedy selection.
  float v[kClusterPer];
  float raw_max = -FLT_MAX;
#pragma unroll
  for (int j = 0; j < kClusterPer; ++j)
    if (live(j)) v[j] = a.logits[id_of(j)], raw_max = fmaxf(raw_max, v[j]);
  for (int o = 16; o > 0; o >>= 1) raw_max = fmaxf(raw_max, __shfl_xor_sync(~0u, raw_max, o));
  if (lane == 0) s_f[wid] = raw_max;
  __syncthreads();
  raw_max = s_f[lane];
  for (int o = 16; o > 0; o >>= 1) raw_max = fmaxf(raw_max, __shfl_xor_sync(~0u, raw_max, o));
  double sum = 0.0;
  float x_max = -FLT_MAX;
  int x_arg = n;
  uint32_t key[kClusterPer];
#pragma unroll
  for (int j = 0; j < kClusterPer; ++j)
    if (live(j)) {
      sum += double(expf(v[j] - raw_max));
      const float x = processed(a, id_of(j), v[j]);
      key[j] = fkey(x);
      argmax_merge(x_max, x_arg, x, id_of(j));
    }
  for (int o = 16; o > 0; o >>= 1) {
    sum += __shfl_xor_sync(~0u, sum, o);
    argmax_merge(x_max, x_arg, __shfl_xor_sync(~0u, x_max, o), __shfl_xor_sync(~0u, x_arg, o));
  }
  if (lane == 0) s_d[wid] = sum, s_x[wid] = x_max, s_i[wid] = x_arg;
  __syncthreads();
  if (wid == 0) {
    sum = s_d[lane], x_max = s_x[lane], x_arg = s_i[lane];
    for (int o = 16; o > 0; o >>= 1) {
      sum += __shfl_xor_sync(~0u, sum, o);
      argmax_merge(x_max, x_arg, __shfl_xor_sync(~0u, x_max, o), __shfl_xor_sync(~0u, x_arg, o));
    }
    if (lane == 0) b_raw_max = raw_max, b_sum = sum, b_x_max = x_max, b_x_arg = x_arg;
  }
  if (rank == 0 && tid == 0) LILY_TRACE_PHASE(1);
  cluster_sync();
  if (rank == 0 && tid == 0) LILY_TRACE_PHASE(2);
  if (rank == 0 && wid == 0) {  // lane r merges block r's values; the shuffle trees are fixed, so the sums are too
    float m = -FLT_MAX, xm = -FLT_MAX;
    double sm = 0.0;
    int xa = n;
    if (lane < kClusterBlocks)
      m = *in_block(&b_raw_max, lane), sm = *in_block(&b_sum, lane), xm = *in_block(&b_x_max, lane),
      xa = *in_block(&b_x_arg, lane);
    float M = m;
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(~0u, M, o));
    double S = sm * exp(double(m) - double(M));  // 0 for a lane without a block or a block without ids
    for (int o = 16; o > 0; o >>= 1) {
      S += __shfl_xor_sync(~0u, S, o);
      argmax_merge(xm, xa, __shfl_xor_sync(~0u, xm, o), __shfl_xor_sync(~0u, xa, o));
    }
    if (lane == 0) s_lse = double(M) + log(S), b_x_max = xm, b_x_arg = xa;  // block 0's copies: the cluster's now
  }

  int token = -1;
  if (a.p.temperature != 0.0f) {
    // 3. the k-th largest key: up to four radix rounds over the cluster's histograms.
    const int k = (a.p.top_k > 0 && a.p.top_k < n) ? a.p.top_k : n;
    uint32_t prefix = 0;  // the key of the k-th largest x (0 when every id is kept)
    if (k < n) {
      if (tid == 0) s_need = k, s_prefix = 0;
      for (int round = 0; round < 4; ++round) {
        const int shift = 24 - 8 * round;
        uint32_t* h = hist[round & 1];  // the other one may still be read by a block in the previous round
        if (tid < 256) h[tid] = 0;
        __syncthreads();
        const uint32_t pre = s_prefix, mask_hi = round == 0 ? 0u : (0xFFFFFFFFu << (shift + 8));
#pragma unroll
        for (int j = 0; j < kClusterPer; ++j)
          if (live(j) && (key[j] & mask_hi) == (pre & mask_hi)) atomicAdd(&h[(key[j] >> shift) & 255u], 1u);
        cluster_sync();
        if (tid < 256) {  // all 16 remote loads in flight before the first add
          uint32_t c[kClusterBlocks];
#pragma unroll
          for (int r = 0; r < kClusterBlocks; ++r) c[r] = in_block(h, r)[tid];
#pragma unroll
          for (int r = 1; r < kClusterBlocks; ++r) c[0] += c[r];
          tot[tid] = c[0];
        }
        __syncthreads();
        if (wid == 0) radix_pick_warp(tot, shift, &s_need, &s_prefix, &s_whole);
        __syncthreads();
        if (rank == 0 && tid == 0) LILY_TRACE_PHASE(3 + round);
        if (s_whole) break;  // the same in every block: the same histograms
      }
      prefix = s_prefix;
    }
    // 4. compaction of {i : key ≥ prefix} into block 0, ascending ids: a ballot per row and warp, a prefix over
    // (row, warp) within the block, then over the blocks in rank order.
#pragma unroll
    for (int j = 0; j < kClusterPer; ++j) {
      const unsigned m = __ballot_sync(~0u, live(j) && key[j] >= prefix);
      if (lane == j) s_rows[j][wid] = __popc(m);
    }
    if (lane >= kClusterPer) s_rows[lane][wid] = 0;  // rows no thread holds
    __syncthreads();
    const int cnt = s_rows[tid >> 5][tid & 31];  // entry (row tid/32, warp tid mod 32): scan order = tid order
    int inc = cnt;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(~0u, inc, o);
      if (lane >= o) inc += y;
    }
    if (lane == 31) s_i[wid] = inc;
    __syncthreads();
    if (wid == 0) {
      int w = s_i[lane];
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(~0u, w, o);
        if (lane >= o) w += y;
      }
      s_i[lane] = w;  // inclusive over warps of the scan
      if (lane == 31) b_count = w;
    }
    __syncthreads();
    s_rows[tid >> 5][tid & 31] = inc - cnt + (wid ? s_i[wid - 1] : 0);
    if (rank == 0 && tid == 0) LILY_TRACE_PHASE(7);
    cluster_sync();  // b_count of every block is out; s_rows is complete
    int counts[kClusterBlocks], offset = 0, total = 0;
#pragma unroll
    for (int r = 0; r < kClusterBlocks; ++r) counts[r] = *in_block(&b_count, r);
#pragma unroll
    for (int r = 0; r < kClusterBlocks; ++r) offset += r < int(rank) ? counts[r] : 0, total += counts[r];
    int* out_id = in_block(cand_id, 0);
    float* out_x = in_block(cand_x, 0);
#pragma unroll
    for (int j = 0; j < kClusterPer; ++j) {
      const bool c = live(j) && key[j] >= prefix;
      const unsigned m = __ballot_sync(~0u, c);
      const int at = offset + s_rows[j][wid] + __popc(m & ((1u << lane) - 1u));
      if (c && at < kSampleMaxCand) out_id[at] = id_of(j), out_x[at] = unkey(key[j]);
    }
    cluster_sync();  // block 0's candidates are in; no block reads another's shared memory after this
    if (rank != 0) return;
    if (tid == 0) LILY_TRACE_PHASE(8);
    // 5, 6. top-p, min-p, the draw, by block 0 (thread 0's merge is behind the barriers above).
    token = draw_candidates(a, step, min(total, kSampleMaxCand), b_x_max, b_x_arg, cand_id, cand_x, cand_w,
                            cand_keep, &s_d[0]);
  } else {
    cluster_sync();  // no block leaves while block 0 may still read its b_* values
    if (rank != 0) return;
    token = b_x_arg;
  }
  if (tid == 0) {
    LILY_TRACE_PHASE(9);
    record_token(a, step, token, s_lse);
    LILY_TRACE_PHASE(10);
  }
}

// Whether the device runs a cluster of kClusterBlocks: 16 is past CUDA's portable 8, which Hopper allows once the
// kernel asks (checked once per process; every device of one process is taken to answer alike).
bool cluster_sampler_fits() {
  static const bool fits = [] {
    int clusters = 0;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = kClusterBlocks;
    cfg.blockDim = kSampleThreads;
    const bool ok =
        cudaFuncSetAttribute(sample_cluster_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess &&
        cudaOccupancyMaxActiveClusters(&clusters, sample_cluster_kernel, &cfg) == cudaSuccess;
    if (!ok) (void)cudaGetLastError();  // not an error of the caller's: the one-block kernel runs instead
    return ok && clusters > 0;
  }();
  return fits;
}

void sample(Ctx& ctx, const SamplingParams& p, int n_valid, const float* logits, const DeviceSampler& st) {
  LILY_CHECK(device_can_sample(p, n_valid), "CUDA sample: these sampling parameters need the host sampler");
  const SampleKernelArgs args{p, n_valid, logits, st};
  if (ctx.opts.on(Opt::sample_cluster) && n_valid <= kClusterMaxN && cluster_sampler_fits())
    launch(ctx, sample_cluster_kernel, kClusterBlocks, kSampleThreads, 0, args);
  else
    launch(ctx, sample_kernel, 1, kSampleThreads, 0, args);
  check_launch("sample");
}

}  // namespace lily::cuda
