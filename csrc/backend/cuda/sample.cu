// sample.cu: token selection on the GPU, so a decode step never waits for the host (core/sample.h is the rule
// book and the host reference; this kernel follows it step for step).
//
// Math     x_i = raw_i with penalties (repetition on seen ids, frequency/presence on generated ids), / temperature;
//          T = 0: argmax x (lowest id on ties). Else keep x_i ≥ k-th largest x (top-k, ties kept), then top-p
//          (keep i iff Σ_{x_j > x_i} w_j < top_p·Σ w, w = exp(x − x_max)), then min-p (w_i ≥ min_p); draw
//          u = to_unit_double(splitmix64(seed ^ step·φ)) and take the first kept id (ascending) whose running Σ w
//          exceeds u·Σ w. logprob = raw_token − logsumexp(raw) over [0, n_valid).
// Mapping  one block of 1024 threads: two coalesced passes over the logits (max/argmax, then Σexp), four radix
//          passes (8 bits each) for the k-th largest, one ordered compaction of the ≤ kSampleMaxCand candidates
//          into shared memory, then O(n²) top-p masses over the candidates and a serial draw by thread 0.
// Traffic  V = 248320 fp32 logits read ~7 times from L2 (≈ 7 MB); ~30 µs on one SM. Versus the host path: the 1 MB
//          copy and a 1.3 ms host pass per token.
// Checks   the host calls sample() only when can_sample() (backend/policy.h: device_can_sample): greedy, or the
//          top-k set fits kSampleMaxCand, and top_logprobs == 0. Ties at the top-k boundary beyond kSampleMaxCand
//          keep the lowest ids (host path keeps all).
// Ref      core/sample.cpp · Test tests/test_cuda.py (device sampler vs host sampler)
// History  v1 (this)
#include <cfloat>

#include "backend/cuda/ops.cuh"

namespace lily::cuda {

constexpr int kSampleThreads = 1024;

struct SampleKernelArgs {
  SamplingParams p;
  int n_valid;
  const float* logits;
  DeviceSampler st;
};

__device__ __forceinline__ float processed(const SampleKernelArgs& a, int i) {
  float x = a.logits[i];
  if (a.p.repetition_penalty != 1.0f && a.st.seen[i]) x = x > 0 ? x / a.p.repetition_penalty : x * a.p.repetition_penalty;
  const int c = a.st.counts[i];
  if (c > 0) x -= a.p.frequency_penalty * float(c) + a.p.presence_penalty;
  if (a.p.temperature > 0) x /= a.p.temperature;
  return x;
}

// Order-preserving map of a float to uint32 (larger float → larger key).
__device__ __forceinline__ uint32_t fkey(float f) {
  uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint64_t splitmix64_d(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__global__ void __launch_bounds__(kSampleThreads) sample_kernel(const SampleKernelArgs a) {
  pdl_trigger();
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
    const float x = processed(a, i);
    if (x > x_max || (x == x_max && i < x_arg)) x_max = x, x_arg = i;
  }
  for (int o = 16; o > 0; o >>= 1) {
    raw_max = fmaxf(raw_max, __shfl_xor_sync(~0u, raw_max, o));
    const float ox = __shfl_xor_sync(~0u, x_max, o);
    const int oi = __shfl_xor_sync(~0u, x_arg, o);
    if (ox > x_max || (ox == x_max && oi < x_arg)) x_max = ox, x_arg = oi;
  }
  if (lane == 0) s_f[wid] = raw_max;
  __syncthreads();
  raw_max = s_f[lane];
  for (int o = 16; o > 0; o >>= 1) raw_max = fmaxf(raw_max, __shfl_xor_sync(~0u, raw_max, o));
  __syncthreads();
  if (lane == 0) s_f[wid] = x_max, s_i[wid] = x_arg;
  __syncthreads();
  x_max = s_f[lane], x_arg = s_i[lane];
  for (int o = 16; o > 0; o >>= 1) {
    const float ox = __shfl_xor_sync(~0u, x_max, o);
    const int oi = __shfl_xor_sync(~0u, x_arg, o);
    if (ox > x_max || (ox == x_max && oi < x_arg)) x_max = ox, x_arg = oi;
  }

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
        if (tid == 0) {
          int need = s_need, b = 255;
          while (b > 0 && int(hist[b]) < need) need -= hist[b--];
          s_need = need;
          s_prefix = pre | (uint32_t(b) << shift);
        }
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
    const int nc = s_ncand;
    for (int j = tid; j < nc; j += kSampleThreads) {
      cand_w[j] = double(expf(cand_x[j] - x_max));
      cand_keep[j] = 1;
    }
    __syncthreads();
    // 5. top-p: keep j iff the mass strictly above it is < top_p·total.
    if (a.p.top_p < 1.0f) {
      if (tid == 0) {
        double total = 0;
        for (int j = 0; j < nc; ++j) total += cand_w[j];
        s_d[0] = total;
      }
      __syncthreads();
      const double target = double(a.p.top_p) * s_d[0];
      for (int j = tid; j < nc; j += kSampleThreads) {
        double above = 0;
        for (int m = 0; m < nc; ++m) above += cand_x[m] > cand_x[j] ? cand_w[m] : 0.0;
        cand_keep[j] = above < target;
      }
      __syncthreads();
    }
    // 6. min-p, then the draw over the kept candidates in ascending id order.
    if (tid == 0) {
      double total = 0;
      for (int j = 0; j < nc; ++j) {
        cand_keep[j] = cand_keep[j] && cand_w[j] >= double(a.p.min_p);
        if (cand_keep[j]) total += cand_w[j];
      }
      const uint64_t step = *a.st.step;
      const double u = double(splitmix64_d(a.p.seed ^ (step * 0x9E3779B97F4A7C15ull)) >> 11) * 0x1.0p-53;
      const double target = u * total;
      double cum = 0;
      int pick = -1;
      for (int j = 0; j < nc; ++j) {
        if (!cand_keep[j]) continue;
        pick = j;
        if ((cum += cand_w[j]) > target) break;
      }
      s_token = pick >= 0 ? cand_id[pick] : x_arg;
    }
  }
  __syncthreads();
  if (tid == 0) {
    const int t = s_token;
    const uint64_t step = *a.st.step;
    *a.st.token = t;
    int32_t* r = a.st.results + 2 * int(step % kResultSlots);
    r[0] = t;
    r[1] = __float_as_int(float(double(a.logits[t]) - lse));
    a.st.counts[t] += 1;
    a.st.seen[t] = 1;
    *a.st.step = step + 1;
    if (a.st.pos) *a.st.pos += 1;
  }
}

void sample(Ctx& ctx, const SamplingParams& p, int n_valid, const float* logits, const DeviceSampler& st) {
  LILY_CHECK(device_can_sample(p, n_valid), "CUDA sample: these sampling parameters need the host sampler");
  launch(ctx, sample_kernel, 1, kSampleThreads, 0, SampleKernelArgs{p, n_valid, logits, st});
  check_launch("sample");
}

}  // namespace lily::cuda
