// sample.metal: token selection on the GPU, so a decode step never waits for the host (core/sample.h is the rule
// book and the host reference; this kernel follows it step for step, as cuda/sample.cu does).
//
// Math     x_i = raw_i with penalties (repetition on seen ids, frequency/presence on generated ids), / temperature;
//          temperature 0: argmax x (lowest id on ties). Else keep x_i ≥ k-th largest x (top-k, ties kept), then
//          top-p (keep i iff Σ_{x_j > x_i} w_j < top_p·Σ w, w = exp(x − x_max)), then min-p (w_i ≥ min_p); draw
//          u = to_unit(splitmix64(seed ^ step·φ)) and take the first kept id (ascending) whose running Σ w exceeds
//          u·Σ w. logprob = raw_token − logsumexp(raw) over [0, n_valid).
// Numerics MSL has no double. The host sums the float weights w in double; here every such sum (top-p masses, the
//          kept total, the running sum of the draw) is a two-float sum (hi + lo, Knuth's two-sum per term, ≈ 48
//          bits), u is the same 53-bit integer split into two floats, and u·Σ w is formed with an fma. So the
//          decisions match the host's except where two sums differ by less than ~2^-44 relatively, far below
//          the few-ulp difference between Metal's exp and the host's, which this kernel shares with the CUDA one.
//          The logsumexp for the logprob is a plain fp32 sum (~1e-6 relative: the logprob is reported as fp32).
// Layout   logits f32[V]; counts i32[n_valid], seen u8[n_valid], step u64, token i32, results i32[kResultSlots, 2],
//          pos i32 (DeviceSampler, backend.h).
// Traffic  V = 248320: the fp32 logits read ~7 times (≈ 7 MB, mostly from the system-level cache); one threadgroup
//          on one core: ~50-100 µs expected on an M-series GPU, against a 1 MB copy and a ~1.3 ms host pass.
// Mapping  one threadgroup of 1024 threads (32 simdgroups): two strided passes over the logits (max / argmax, then
//          Σ exp), four radix passes of 8 bits for the k-th largest x (threadgroup atomic histogram: the counts do
//          not depend on the order), an ordered compaction of the ≤ 1024 candidates (each thread a contiguous id
//          range, simd prefix scan), top-p masses in O(n²) over the candidates, then the min-p filter and the
//          draw by thread 0, which also updates counts, seen, step, the results slot and pos.
// Checks   (launcher) can_sample(): greedy, or the top-k set fits SAMPLE_MAX_CAND, and top_logprobs == 0. Ties at
//          the top-k boundary beyond SAMPLE_MAX_CAND keep the lowest ids (the host keeps all).
// Ref      core/sample.cpp · Test tests/metal/test_metal_sample.py · Launcher csrc/backend/metal/sample.cpp
// History  v1 (this)
#include "common.h"
#include "sample_args.h"

// ---- helpers --------------------------------------------------------------------------------------------------

// The penalised, temperature-scaled logit x_i (core/sample.cpp, Sampler::process).
inline float processed(constant SampleKernelArgs& a, device const float* logits, device const int* counts,
                       device const uchar* seen, int i) {
  float x = logits[i];
  if (a.repetition_penalty != 1.0f && seen[i] != 0)
    x = x > 0.0f ? x / a.repetition_penalty : x * a.repetition_penalty;
  const int c = counts[i];
  if (c > 0) x -= a.frequency_penalty * float(c) + a.presence_penalty;
  if (a.temperature > 0.0f) x /= a.temperature;
  return x;
}

// Order-preserving map of a float to uint (larger float → larger key).
inline uint fkey(float f) {
  const uint u = as_type<uint>(f);
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

// splitmix64 finaliser of x + φ (core/sample.cpp).
inline ulong splitmix64(ulong x) {
  ulong z = x + 0x9E3779B97F4A7C15ul;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ul;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBul;
  return z ^ (z >> 31);
}

// A two-float sum hi + lo (|lo| ≤ ulp(hi)/2): the double accumulators of the host, without double.
struct Sum2 {
  float hi;
  float lo;
};

// a + b, the rounding error of hi + b carried into lo (Knuth's two-sum).
inline Sum2 sum2_add(Sum2 a, float b) {
  const float s = a.hi + b, bb = s - a.hi;
  const float e = ((a.hi - (s - bb)) + (b - bb)) + a.lo;
  const float hi = s + e;
  return Sum2{hi, e - (hi - s)};
}

// a·f, the rounding error of hi·f from an fma.
inline Sum2 sum2_mul(Sum2 a, float f) {
  const float p = a.hi * f;
  const float e = fma(a.hi, f, -p) + a.lo * f;
  const float hi = p + e;
  return Sum2{hi, e - (hi - p)};
}

// a > b (a.hi − b.hi is exact whenever the two are close: Sterbenz).
inline bool sum2_greater(Sum2 a, Sum2 b) { return (a.hi - b.hi) + (a.lo - b.lo) > 0.0f; }

// ---- kernel ---------------------------------------------------------------------------------------------------

[[kernel]] void sample(
    constant SampleKernelArgs& a [[buffer(0)]],
    device const float* logits [[buffer(1)]],
    device int* counts [[buffer(2)]],
    device uchar* seen [[buffer(3)]],
    device ulong* step [[buffer(4)]],
    device int* token [[buffer(5)]],
    device int* results [[buffer(6)]],
    device int* pos [[buffer(7)]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float s_raw[32];
  threadgroup float s_x[32];
  threadgroup int s_arg[32];
  threadgroup float s_sum[32];
  threadgroup int s_cnt[32];
  threadgroup atomic_uint hist[256];
  threadgroup uint s_sel[2];  // radix selection: the rank still needed, the key prefix found so far
  threadgroup float s_tot[2];
  threadgroup int cand_id[SAMPLE_MAX_CAND];
  threadgroup float cand_x[SAMPLE_MAX_CAND];
  threadgroup float cand_w[SAMPLE_MAX_CAND];
  threadgroup uchar cand_keep[SAMPLE_MAX_CAND];
  const int n = a.n_valid, nt = SAMPLE_THREADS, me = int(tid);

  // 1. raw max, processed max and argmax (lowest id among equal maxima).
  float raw_max = -INFINITY, x_max = -INFINITY;
  int x_arg = n;
  for (int i = me; i < n; i += nt) {
    raw_max = max(raw_max, logits[i]);
    const float x = processed(a, logits, counts, seen, i);
    if (x > x_max || (x == x_max && i < x_arg)) {
      x_max = x;
      x_arg = i;
    }
  }
  raw_max = simd_max(raw_max);
  float best = simd_max(x_max);
  x_arg = simd_min(x_max == best ? x_arg : n);
  if (lane == 0) {
    s_raw[sg] = raw_max;
    s_x[sg] = best;
    s_arg[sg] = x_arg;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  raw_max = simd_max(s_raw[lane]);
  x_max = simd_max(s_x[lane]);
  x_arg = simd_min(s_x[lane] == x_max ? s_arg[lane] : n);

  // 2. Σ exp(raw − raw max), for the logprob.
  float sum = 0.0f;
  for (int i = me; i < n; i += nt) sum += exp(logits[i] - raw_max);
  sum = simd_sum(sum);
  if (lane == 0) s_sum[sg] = sum;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  sum = simd_sum(s_sum[lane]);

  int pick_id = x_arg;
  if (a.temperature != 0.0f) {
    // 3. the key of the k-th largest x, by radix selection (8 bits at a time, from the top).
    const int k = (a.top_k > 0 && a.top_k < n) ? a.top_k : n;
    uint prefix = 0u;
    if (k < n) {
      if (me == 0) {
        s_sel[0] = uint(k);
        s_sel[1] = 0u;
      }
      for (int shift = 24; shift >= 0; shift -= 8) {
        if (me < 256) atomic_store_explicit(&hist[me], 0u, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        const uint pre = s_sel[1], mask_hi = shift == 24 ? 0u : (0xFFFFFFFFu << uint(shift + 8));
        for (int i = me; i < n; i += nt) {
          const uint key = fkey(processed(a, logits, counts, seen, i));
          if ((key & mask_hi) == (pre & mask_hi))
            atomic_fetch_add_explicit(&hist[(key >> uint(shift)) & 255u], 1u, memory_order_relaxed);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (me == 0) {
          uint need = s_sel[0];
          int b = 255;
          while (b > 0 && atomic_load_explicit(&hist[b], memory_order_relaxed) < need)
            need -= atomic_load_explicit(&hist[b--], memory_order_relaxed);
          s_sel[0] = need;
          s_sel[1] = pre | (uint(b) << uint(shift));
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
      }
      prefix = s_sel[1];
    }

    // 4. compaction of {i : key(x_i) ≥ prefix} in ascending id order: each thread owns a contiguous id range.
    const int per = (n + nt - 1) / nt, lo = min(n, me * per), hi = min(n, lo + per);
    int mine = 0;
    for (int i = lo; i < hi; ++i) mine += fkey(processed(a, logits, counts, seen, i)) >= prefix ? 1 : 0;
    const int before_in_sg = simd_prefix_exclusive_sum(mine), sg_total = simd_sum(mine);
    if (lane == 0) s_cnt[sg] = sg_total;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int at = before_in_sg, all = 0;
    for (int s = 0; s < 32; ++s) {
      at += s < int(sg) ? s_cnt[s] : 0;
      all += s_cnt[s];
    }
    for (int i = lo; i < hi; ++i) {
      const float x = processed(a, logits, counts, seen, i);
      if (fkey(x) >= prefix) {
        if (at < SAMPLE_MAX_CAND) {
          cand_id[at] = i;
          cand_x[at] = x;
        }
        ++at;
      }
    }
    const int nc = min(all, SAMPLE_MAX_CAND);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int j = me; j < nc; j += nt) {
      cand_w[j] = exp(cand_x[j] - x_max);  // w = exp(x − x_max)
      cand_keep[j] = 1;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // 5. top-p: keep j iff the mass strictly above it is < top_p·total.
    if (a.top_p < 1.0f) {
      if (me == 0) {
        Sum2 total = {0.0f, 0.0f};
        for (int j = 0; j < nc; ++j) total = sum2_add(total, cand_w[j]);
        s_tot[0] = total.hi;
        s_tot[1] = total.lo;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const Sum2 target = sum2_mul(Sum2{s_tot[0], s_tot[1]}, a.top_p);
      for (int j = me; j < nc; j += nt) {
        Sum2 above = {0.0f, 0.0f};
        for (int m = 0; m < nc; ++m)
          if (cand_x[m] > cand_x[j]) above = sum2_add(above, cand_w[m]);
        cand_keep[j] = sum2_greater(target, above) ? 1 : 0;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // 6. min-p, then the draw over the kept candidates in ascending id order.
    if (me == 0) {
      Sum2 total = {0.0f, 0.0f};
      for (int j = 0; j < nc; ++j) {
        cand_keep[j] = (cand_keep[j] != 0 && cand_w[j] >= a.min_p) ? 1 : 0;
        if (cand_keep[j] != 0) total = sum2_add(total, cand_w[j]);
      }
      // u = (r >> 11)·2^-53 with its 24 high bits in u_hi (exact) and its 29 low bits in u_lo.
      const ulong seed = (ulong(a.seed_hi) << 32) | ulong(a.seed_lo);
      const ulong r = splitmix64(seed ^ (step[0] * 0x9E3779B97F4A7C15ul)) >> 11;
      const float two_m24 = 1.0f / 16777216.0f, two_m53 = two_m24 / 536870912.0f;
      const float u_hi = float(uint(r >> 29)) * two_m24, u_lo = float(uint(r & 0x1FFFFFFFul)) * two_m53;
      const Sum2 target = sum2_add(sum2_mul(total, u_hi), total.hi * u_lo);  // u·Σ w
      Sum2 cum = {0.0f, 0.0f};
      int pick = -1;
      for (int j = 0; j < nc; ++j) {
        if (cand_keep[j] == 0) continue;
        pick = j;
        cum = sum2_add(cum, cand_w[j]);
        if (sum2_greater(cum, target)) break;
      }
      if (pick >= 0) pick_id = cand_id[pick];
    }
  }

  // 7. thread 0 records the token: the next step's input, the results slot, the penalty state, the counters.
  if (me == 0) {
    const int t = pick_id;
    const ulong st = step[0];
    token[0] = t;
    device int* slot = results + 2 * int(st % ulong(SAMPLE_RESULT_SLOTS));
    slot[0] = t;
    slot[1] = as_type<int>((logits[t] - raw_max) - log(sum));  // log_softmax(raw)[t]
    counts[t] += 1;
    seen[t] = 1;
    step[0] = st + 1;
    if (a.has_pos != 0) pos[0] += 1;
  }
}
