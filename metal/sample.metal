// sample.metal: token selection on the GPU, so a decode step never waits for the host (core/sample.h is the rule
// book and the host reference; these kernels follow it step for step, as cuda/sample.cu does).
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
//          The logsumexp for the logprob is a plain fp32 sum (~1e-6 relative: the logprob is reported as fp32);
//          sample_split sums each slice against its own max and rescales the slice sums by exp(m_s − max).
// Layout   logits f32[V]; counts i32[n_valid], seen u8[n_valid], step u64, token i32, results i32[kResultSlots, 2],
//          pos i32 (DeviceSampler, backend.h). sample_split's scratch (backend/scratch.h: sample_parts, one slot
//          grown once): SamplePartial[G] (sample_args.h), then candidate ids i32[G, 2048] and their x f32[G, 2048].
// Traffic  n = 248,077 (V = 248,320). `sample` reads the fp32 logits ~7 times (and the i32 counts when frequency or
//          presence penalties are on, the u8 seen with a repetition penalty) on one GPU core; CUDA's one-block
//          kernel of the same design took ~685 µs on one H100 SM. sample_split reads them once over every core:
//          1 MB (2.2 MB with all penalties) at ~100–400 GB/s is 2.5–10 µs (5–22 µs), plus each threadgroup's chain
//          of ~16 barriers and the merge over G partials and ≤ G·k candidates: ~10–20 µs greedy, ~15–40 µs sampled
//          expected (benchmarks/NOTES.md, Metal), unmeasured.
// Mapping  sample (switch sample_split off): one threadgroup of 1024 threads (32 simdgroups): two strided passes
//          over the logits (max / argmax, then Σ exp), four radix passes of 8 bits for the k-th largest x
//          (threadgroup atomic histogram: the counts do not depend on the order), an ordered compaction of the
//          ≤ 1024 candidates (each thread a contiguous id range, simd prefix scan), then the tail: top-p masses in
//          O(n²) over the candidates, the min-p filter and the draw by thread 0, which also updates counts, seen,
//          step, the results slot and pos.
//          sample_split, two dispatches (no threadgroup ever waits for another: Metal promises no forward progress
//          between them). sample_part: G = ⌈n/4096⌉ threadgroups of 1024 threads; threadgroup g owns the slice
//          [4096g, 4096g + 4096), each thread 4 consecutive ids read once into registers: the slice's raw max m_s,
//          Σ exp(raw − m_s), max and argmax of x; when sampling, the slice's k-th largest key P_s (the same radix
//          rounds, on the registers) and its candidates C_s in id order: every id with key > P_s, and the first 1024
//          ids with key ≥ P_s. sample_merge: one threadgroup of 1024 threads; thread s takes slice s's partial (max,
//          Σ·exp(m_s − max), argmax), a simdgroup a slice runs the radix rounds and the ordered compaction over the
//          union U of the C_s (slice after slice: id order), then the tail of `sample`, shared.
// Why U    Let P be the k-th largest key of all ids, T = {key ≥ P} and K its first 1024 ids (what `sample` keeps).
//          A slice holds k keys ≥ P_s, so P ≥ P_s. If P > P_s, T ∩ slice ⊆ {key > P_s} ⊆ C_s; if P = P_s, K ∩ slice
//          is a prefix of the slice's {key ≥ P_s} of ≤ 1024 ids, in C_s too. So K ⊆ U: U's k-th largest is P (K has
//          ≥ k keys ≥ P) and the first 1024 ids of U ∩ T are K. Only ties can make a slice's {key ≥ P_s} exceed
//          1024 ids; then C_s holds up to 1024 + k − 1 (≤ 2047) ids: the first 1024 ties and the ids above P_s.
// Slices   4096 ids: at n = 248,077, G = 61 threadgroups, 1.5–6 per core of an M-series GPU (10–40 cores), so every
//          core works, and a thread's 4 ids are one 16-byte run. Smaller slices add threadgroups whose fixed chain
//          (four radix rounds, two scans, ~16 barriers) is the same, and grow the union the merge scans (G·k: 62K
//          at k = 1024); 8192 would leave 31 threadgroups, fewer than the cores of the large chips.
// Checks   (launcher) can_sample(): greedy, or the top-k set fits SAMPLE_MAX_CAND, and top_logprobs == 0. Ties at
//          the top-k boundary beyond SAMPLE_MAX_CAND keep the lowest ids (the host keeps all), in both forms.
//          sample_split takes n ≤ SAMPLE_SLICE·SAMPLE_MAX_PARTS (4,194,304); above, `sample` runs.
// Ref      core/sample.cpp · Test tests/metal/test_metal_sample.py · Launcher csrc/backend/metal/sample.cpp
// History  v1 one threadgroup · v2 (2026-12-05) sample_split: two dispatches, the logits read once over G
//          threadgroups (unmeasured: no Mac); the radix pick by one simdgroup instead of a loop in thread 0.
#include "common.h"
#include "sample_args.h"

// ---- helpers --------------------------------------------------------------------------------------------------

// The penalised, temperature-scaled logit x_i of id i from its raw logit (core/sample.cpp, Sampler::process).
// counts is read only when a frequency or presence penalty is set (the host applies none otherwise).
inline float processed(constant SampleKernelArgs& a, float raw, device const int* counts, device const uchar* seen,
                       int i) {
  float x = raw;
  if (a.repetition_penalty != 1.0f && seen[i] != 0)
    x = x > 0.0f ? x / a.repetition_penalty : x * a.repetition_penalty;
  if (a.frequency_penalty != 0.0f || a.presence_penalty != 0.0f) {
    const int c = counts[i];
    if (c > 0) x -= a.frequency_penalty * float(c) + a.presence_penalty;
  }
  if (a.temperature > 0.0f) x /= a.temperature;
  return x;
}

// Order-preserving map of a float to uint (larger float → larger key).
inline uint fkey(float f) {
  const uint u = as_type<uint>(f);
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}

// (x, id) pairs ordered by x, the lower id first among equal x: (x, i) ← the larger of it and (ox, oi).
inline void argmax_merge(thread float& x, thread int& i, float ox, int oi) {
  if (ox > x || (ox == x && oi < i)) {
    x = ox;
    i = oi;
  }
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

// ---- threadgroup steps shared by the kernels (1024 threads: 32 simdgroups; every thread calls them) -------------

// The threadgroup's raw max, and its max x with the lowest id holding it (`none` where no thread has one).
inline void tg_max_argmax(thread float& raw_max, thread float& x_max, thread int& x_arg, int none,
                          threadgroup float* s_raw, threadgroup float* s_x, threadgroup int* s_arg, uint sg,
                          uint lane) {
  raw_max = simd_max(raw_max);
  const float best = simd_max(x_max);
  x_arg = simd_min(x_max == best ? x_arg : none);
  if (lane == 0) {
    s_raw[sg] = raw_max;
    s_x[sg] = best;
    s_arg[sg] = x_arg;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  raw_max = simd_max(s_raw[lane]);
  x_max = simd_max(s_x[lane]);
  x_arg = simd_min(s_x[lane] == x_max ? s_arg[lane] : none);
}

// The threadgroup's sum of v.
inline float tg_sum(float v, threadgroup float* s_sum, uint sg, uint lane) {
  v = simd_sum(v);
  if (lane == 0) s_sum[sg] = v;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return simd_sum(s_sum[lane]);
}

// Ordered compaction: the sum of `mine` over the threads before this one (thread order), and over all in `all`.
// A second call needs another s_cnt (or a barrier between): the first one's reads may still be pending.
inline int tg_scan(int mine, thread int& all, threadgroup int* s_cnt, uint sg, uint lane) {
  const int before_in_sg = simd_prefix_exclusive_sum(mine), sg_total = simd_sum(mine);
  if (lane == 0) s_cnt[sg] = sg_total;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int at = before_in_sg;
  all = 0;
  for (int s = 0; s < 32; ++s) {
    at += s < int(sg) ? s_cnt[s] : 0;
    all += s_cnt[s];
  }
  return at;
}

// Radix selection of the key of the k-th largest, 8 bits a round from the top (shift 24, 16, 8, 0): each round
// radix_begin, radix_add of every key the thread holds, radix_pick; after the last, s_sel[1] is the key.
// s_sel: the rank still needed within the keys matching the prefix, the prefix found so far.
inline uint radix_begin(threadgroup atomic_uint* hist, threadgroup uint* s_sel, int shift, int k, int me) {
  if (me < 256) atomic_store_explicit(&hist[me], 0u, memory_order_relaxed);
  if (shift == 24 && me == 0) {
    s_sel[0] = uint(k);
    s_sel[1] = 0u;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return s_sel[1];
}

inline void radix_add(threadgroup atomic_uint* hist, uint key, uint pre, int shift) {
  const uint mask_hi = shift == 24 ? 0u : (0xFFFFFFFFu << uint(shift + 8));
  if ((key & mask_hi) == (pre & mask_hi))
    atomic_fetch_add_explicit(&hist[(key >> uint(shift)) & 255u], 1u, memory_order_relaxed);
}

// The round's pick: the highest bin b with ≥ need keys at or above it (bin 0 if none), need less the keys above b.
// Simdgroup 0: lane l holds bins 8l .. 8l+7; the suffix sums over the lanes find the lane holding b, which walks its
// bins as the loop `while (b > 0 && hist[b] < need) need -= hist[b--]` would.
inline void radix_pick(threadgroup atomic_uint* hist, threadgroup uint* s_sel, int shift, uint sg, uint lane) {
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    const int need = int(s_sel[0]), l = int(lane);
    int c[8], own = 0;
    for (int i = 0; i < 8; ++i) {
      c[i] = int(atomic_load_explicit(&hist[8 * l + i], memory_order_relaxed));
      own += c[i];
    }
    const int incl = simd_sum(own) - simd_prefix_exclusive_sum(own);  // keys in the bins of lanes ≥ l
    const int at = simd_max(incl >= need ? l : 0);
    if (l == at) {
      int above = incl - own, b = 8 * l + 7;
      for (int i = 7; i > 0 && above + c[i] < need; --i) {
        above += c[i];
        b = 8 * l + i - 1;
      }
      s_sel[0] = uint(need - above);
      s_sel[1] |= uint(b) << uint(shift);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Top-p, min-p and the draw over the nc candidates cand_id / cand_x (ascending ids, processed x) that the caller has
// written: the drawn id in thread 0 (`none` if nothing is kept), `none` in the others.
inline int draw_candidates(constant SampleKernelArgs& a, device const ulong* step, threadgroup const int* cand_id,
                           threadgroup const float* cand_x, threadgroup float* cand_w, threadgroup uchar* cand_keep,
                           threadgroup float* s_tot, int nc, float x_max, int none, int me) {
  const int nt = SAMPLE_THREADS;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int j = me; j < nc; j += nt) {
    cand_w[j] = exp(cand_x[j] - x_max);  // w = exp(x − x_max)
    cand_keep[j] = 1;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // top-p: keep j iff the mass strictly above it is < top_p·total.
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

  // min-p, then the draw over the kept candidates in ascending id order.
  int pick_id = none;
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
  return pick_id;
}

// Thread 0 records token t: the next step's input, the results slot, the penalty state, the counters.
inline void record(constant SampleKernelArgs& a, int t, float raw_max, float sum, device const float* logits,
                   device int* counts, device uchar* seen, device ulong* step, device int* token,
                   device int* results, device int* pos) {
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

// ---- sample: one threadgroup (switch sample_split off) ---------------------------------------------------------

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
  threadgroup uint s_sel[2];
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
    const float raw = logits[i];
    raw_max = max(raw_max, raw);
    argmax_merge(x_max, x_arg, processed(a, raw, counts, seen, i), i);
  }
  tg_max_argmax(raw_max, x_max, x_arg, n, s_raw, s_x, s_arg, sg, lane);

  // 2. Σ exp(raw − raw max), for the logprob.
  float sum = 0.0f;
  for (int i = me; i < n; i += nt) sum += exp(logits[i] - raw_max);
  sum = tg_sum(sum, s_sum, sg, lane);

  int pick_id = x_arg;
  if (a.temperature != 0.0f) {
    // 3. the key of the k-th largest x, by radix selection.
    const int k = (a.top_k > 0 && a.top_k < n) ? a.top_k : n;
    uint prefix = 0u;
    if (k < n) {
      for (int shift = 24; shift >= 0; shift -= 8) {
        const uint pre = radix_begin(hist, s_sel, shift, k, me);
        for (int i = me; i < n; i += nt) radix_add(hist, fkey(processed(a, logits[i], counts, seen, i)), pre, shift);
        radix_pick(hist, s_sel, shift, sg, lane);
      }
      prefix = s_sel[1];
    }

    // 4. compaction of {i : key(x_i) ≥ prefix} in ascending id order: each thread owns a contiguous id range.
    const int per = (n + nt - 1) / nt, lo = min(n, me * per), hi = min(n, lo + per);
    int mine = 0;
    for (int i = lo; i < hi; ++i) mine += fkey(processed(a, logits[i], counts, seen, i)) >= prefix ? 1 : 0;
    int all = 0;
    int at = tg_scan(mine, all, s_cnt, sg, lane);
    for (int i = lo; i < hi; ++i) {
      const float x = processed(a, logits[i], counts, seen, i);
      if (fkey(x) >= prefix) {
        if (at < SAMPLE_MAX_CAND) {
          cand_id[at] = i;
          cand_x[at] = x;
        }
        ++at;
      }
    }

    // 5, 6. top-p, min-p, the draw.
    pick_id = draw_candidates(a, step, cand_id, cand_x, cand_w, cand_keep, s_tot, min(all, SAMPLE_MAX_CAND), x_max,
                              x_arg, me);
  }

  // 7. thread 0 records the token.
  if (me == 0) record(a, pick_id, raw_max, sum, logits, counts, seen, step, token, results, pos);
}

// ---- sample_split: sample_part over the slices, then sample_merge -----------------------------------------------

// Threadgroup g: slice g's partial and, when sampling, its candidates C_g (header: Mapping, Why U) at
// cand_id / cand_x + g·SAMPLE_SLICE_CAND.
[[kernel, max_total_threads_per_threadgroup(1024)]] void sample_part(
    constant SampleKernelArgs& a [[buffer(0)]],
    device const float* logits [[buffer(1)]],
    device const int* counts [[buffer(2)]],
    device const uchar* seen [[buffer(3)]],
    device SamplePartial* part [[buffer(4)]],
    device int* cand_id [[buffer(5)]],
    device float* cand_x [[buffer(6)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float s_raw[32];
  threadgroup float s_x[32];
  threadgroup int s_arg[32];
  threadgroup float s_sum[32];
  threadgroup int s_cnt[32];
  threadgroup int s_cnt2[32];
  threadgroup atomic_uint hist[256];
  threadgroup uint s_sel[2];
  const int n = a.n_valid, me = int(tid);
  const int s0 = int(tg) * SAMPLE_SLICE, s1 = min(n, s0 + SAMPLE_SLICE);
  const int lo = min(s1, s0 + me * SAMPLE_PER), cnt = min(s1, lo + SAMPLE_PER) - lo;  // ids lo .. lo+cnt−1

  // 1. each id read once: raw max, processed max and argmax; then Σ exp(raw − slice max).
  float raw[SAMPLE_PER], x[SAMPLE_PER];
  float raw_max = -INFINITY, x_max = -INFINITY;
  int x_arg = n;
  for (int j = 0; j < SAMPLE_PER; ++j) {
    raw[j] = j < cnt ? logits[lo + j] : -INFINITY;
    x[j] = j < cnt ? processed(a, raw[j], counts, seen, lo + j) : -INFINITY;
    if (j < cnt) {
      raw_max = max(raw_max, raw[j]);
      argmax_merge(x_max, x_arg, x[j], lo + j);
    }
  }
  tg_max_argmax(raw_max, x_max, x_arg, n, s_raw, s_x, s_arg, sg, lane);
  const float m = raw_max == -INFINITY ? 0.0f : raw_max;  // a slice of −∞ logits adds 0
  float sum = 0.0f;
  for (int j = 0; j < cnt; ++j) sum += exp(raw[j] - m);
  sum = tg_sum(sum, s_sum, sg, lane);

  int n_cand = 0;
  if (a.temperature != 0.0f) {
    // 2. the slice's k-th largest key P_s (all its ids when the slice has at most k).
    const int k = (a.top_k > 0 && a.top_k < n) ? a.top_k : n;
    uint key[SAMPLE_PER];
    for (int j = 0; j < SAMPLE_PER; ++j) key[j] = fkey(x[j]);
    uint ps = 0u;
    if (k < s1 - s0) {
      for (int shift = 24; shift >= 0; shift -= 8) {
        const uint pre = radix_begin(hist, s_sel, shift, k, me);
        for (int j = 0; j < cnt; ++j) radix_add(hist, key[j], pre, shift);
        radix_pick(hist, s_sel, shift, sg, lane);
      }
      ps = s_sel[1];
    }

    // 3. C_s in id order: the ids with key > P_s, and those with key ≥ P_s among the first SAMPLE_MAX_CAND of them.
    int ge = 0;
    for (int j = 0; j < cnt; ++j) ge += key[j] >= ps ? 1 : 0;
    int all_ge = 0;
    const int rank0 = tg_scan(ge, all_ge, s_cnt, sg, lane);  // rank of this thread's first id among {key ≥ P_s}
    int mine = 0, rank = rank0;
    for (int j = 0; j < cnt; ++j)
      if (key[j] >= ps) mine += (rank++ < SAMPLE_MAX_CAND || key[j] > ps) ? 1 : 0;
    int at = tg_scan(mine, n_cand, s_cnt2, sg, lane);
    device int* out_id = cand_id + int(tg) * SAMPLE_SLICE_CAND;
    device float* out_x = cand_x + int(tg) * SAMPLE_SLICE_CAND;
    rank = rank0;
    for (int j = 0; j < cnt; ++j)
      if (key[j] >= ps && (rank++ < SAMPLE_MAX_CAND || key[j] > ps)) {
        out_id[at] = lo + j;
        out_x[at] = x[j];
        ++at;
      }
  }

  if (me == 0) {
    device SamplePartial& p = part[tg];
    p.raw_max = raw_max;
    p.sum = sum;
    p.x_max = x_max;
    p.x_arg = x_arg;
    p.n_cand = n_cand;
  }
}

// One threadgroup: the G = ⌈n_valid / SAMPLE_SLICE⌉ partials of sample_part merged, then the tail of `sample`.
[[kernel, max_total_threads_per_threadgroup(1024)]] void sample_merge(
    constant SampleKernelArgs& a [[buffer(0)]],
    device const float* logits [[buffer(1)]],
    device int* counts [[buffer(2)]],
    device uchar* seen [[buffer(3)]],
    device ulong* step [[buffer(4)]],
    device int* token [[buffer(5)]],
    device int* results [[buffer(6)]],
    device int* pos [[buffer(7)]],
    device const SamplePartial* part [[buffer(8)]],
    device const int* part_id [[buffer(9)]],
    device const float* part_x [[buffer(10)]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float s_raw[32];
  threadgroup float s_x[32];
  threadgroup int s_arg[32];
  threadgroup float s_sum[32];
  threadgroup int s_cnt[32];
  threadgroup atomic_uint hist[256];
  threadgroup uint s_sel[2];
  threadgroup float s_tot[2];
  threadgroup int s_base[SAMPLE_MAX_PARTS];
  threadgroup int cand_id[SAMPLE_MAX_CAND];
  threadgroup float cand_x[SAMPLE_MAX_CAND];
  threadgroup float cand_w[SAMPLE_MAX_CAND];
  threadgroup uchar cand_keep[SAMPLE_MAX_CAND];
  const int n = a.n_valid, me = int(tid), parts = (n + SAMPLE_SLICE - 1) / SAMPLE_SLICE;

  // 1. thread s takes slice s: the maxima and argmax, then the slice sums rescaled to the global raw max.
  float raw_max = -INFINITY, x_max = -INFINITY;
  int x_arg = n;
  if (me < parts) {
    raw_max = part[me].raw_max;
    x_max = part[me].x_max;
    x_arg = part[me].x_arg;
  }
  tg_max_argmax(raw_max, x_max, x_arg, n, s_raw, s_x, s_arg, sg, lane);
  const float sum = tg_sum(me < parts ? part[me].sum * exp(part[me].raw_max - raw_max) : 0.0f, s_sum, sg, lane);

  int pick_id = x_arg;
  if (a.temperature != 0.0f) {
    // 2. the k-th largest key of the union U of the slices' candidates (simdgroup sg takes slices sg, sg + 32, …).
    const int k = (a.top_k > 0 && a.top_k < n) ? a.top_k : n;
    uint prefix = 0u;
    if (k < n) {
      for (int shift = 24; shift >= 0; shift -= 8) {
        const uint pre = radix_begin(hist, s_sel, shift, k, me);
        for (int s = int(sg); s < parts; s += 32) {
          const int nc = part[s].n_cand;
          for (int j = int(lane); j < nc; j += 32) radix_add(hist, fkey(part_x[s * SAMPLE_SLICE_CAND + j]), pre, shift);
        }
        radix_pick(hist, s_sel, shift, sg, lane);
      }
      prefix = s_sel[1];
    }

    // 3. compaction of {u ∈ U : key ≥ prefix} in U's order (ascending ids): each slice's count, their scan over
    //    the slices, then each simdgroup places its slices' candidates.
    for (int s = int(sg); s < parts; s += 32) {
      const int nc = part[s].n_cand;
      int c = 0;
      for (int j = int(lane); j < nc; j += 32) c += fkey(part_x[s * SAMPLE_SLICE_CAND + j]) >= prefix ? 1 : 0;
      c = simd_sum(c);
      if (lane == 0) s_base[s] = c;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    int all = 0;
    const int base = tg_scan(me < parts ? s_base[me] : 0, all, s_cnt, sg, lane);
    if (me < parts) s_base[me] = base;  // each thread rewrites only the entry it read
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int s = int(sg); s < parts; s += 32) {
      const int nc = part[s].n_cand;
      int at = s_base[s];
      for (int j0 = 0; j0 < nc && at < SAMPLE_MAX_CAND; j0 += 32) {
        const int j = j0 + int(lane);
        const float x = j < nc ? part_x[s * SAMPLE_SLICE_CAND + j] : 0.0f;
        const int kept = j < nc && fkey(x) >= prefix ? 1 : 0;
        const int p = at + simd_prefix_exclusive_sum(kept);
        if (kept != 0 && p < SAMPLE_MAX_CAND) {
          cand_id[p] = part_id[s * SAMPLE_SLICE_CAND + j];
          cand_x[p] = x;
        }
        at += simd_sum(kept);
      }
    }

    // 4. top-p, min-p, the draw.
    pick_id = draw_candidates(a, step, cand_id, cand_x, cand_w, cand_keep, s_tot, min(all, SAMPLE_MAX_CAND), x_max,
                              x_arg, me);
  }

  if (me == 0) record(a, pick_id, raw_max, sum, logits, counts, seen, step, token, results, pos);
}
