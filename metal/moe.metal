// moe.metal: the sparse MoE block (architecture.md §6) on Apple GPUs: routing, the fused decode kernels, and the
// GPU-resident expert sort, SwiGLU and combine of the prefill path (whose GEMMs are qmm.metal's moe_gemm).
//
// Math     ℓ = m·W_routerᵀ (qmm, f32);  P = softmax(ℓ) (fp32);  top-k by P, ties → lower expert id;
//          ŵ_e = P_e / Σ_topk P (norm_topk_prob) else P_e;
//          y_e = W_down[e]·(silu(W_gate[e]·m) ⊙ (W_up[e]·m));  s = W_sd·(silu(W_sg·m) ⊙ (W_su·m));
//          γ = σ(m·w_seg);  out = Σ_topk ŵ_e·y_e + γ·s   (fp32 accumulation, bf16 out)
//          Every dot of 8 codes of one group uses the MLX identity Σ (s·q + b)·x = s·Σ q·x + b·Σ x.
// Layout   m, out bf16[T, H]; experts W_gate/W_up u32[E, I, H·bits/32], W_down u32[E, H, I·bits/32], scales and
//          biases bf16[E, N, K/group] (§9.3); shared [IS, H], [IS, H], [H, IS]; router [E, H]; w_seg [1, H].
//          Route: ids i32[T, k], ŵ f32[T, k], γ f32[T].  Decode: h f32[T, k+1, max(I, IS)] (slot k = shared).
//          Prefill: tile_counts, tile_base i32[tiles, E]; offsets i32[E+1]; rows, pos i32[T·k]; the shared
//          expert's g, u f32[T, IS] and h bf16[T, IS]; yd bf16[T·k, H] (from moe_gemm), s bf16[T, H].
// Traffic  real shape (H 2048, E 256, k 8, I = IS 512, experts 4-bit, router/w_seg 8-bit), decode T=1:
//          router 0.557 MB + 8 experts 14.156 MB + shared 1.769 MB + w_seg 2 KB = 16.48 MB per layer.
// Work     decode 2·(256·2048 + 9·3·512·2048) = 57.7 MFLOP → 3.5 FLOP/B: bandwidth-bound.
//          Floor on an M3 Max (400 GB/s): 16.48 MB → 41 µs per layer (1.65 ms per token over 40 layers).
//          Prefill T=512: 29.5 GFLOP per layer, in moe_gemm and qmm; the kernels of this file move about
//          T·k·H·2 B·3 (yd written and read, out) = 50 MB at T=512 → 126 µs at 400 GB/s.
// Mapping  moe_route_s{4,8}: one simdgroup per token (4 per threadgroup); lane holds P of experts lane + 32·i;
//          k rounds of simd_max / simd_min (value, then lowest id); the same simdgroup computes γ.
//          Decode (T ≤ kQmvMaxT), two dispatches. moe_gate_up_q{4,8}: threadgroup = (slot j ∈ k routed + shared,
//          tile of 16 rows) × token, 4 simdgroups × 4 rows; the expert id comes from ids in device memory (switch
//          route_fused: from the router logits, each routed simdgroup running the top-k up to its slot, and no
//          moe_route dispatch: threadgroup 0 writes the routing and γ for moe_down; the CUDA switch's port; with
//          route_logits the picks on the logits, the softmax only for the picked weights: pick_expert, pick_write); lane
//          owns blocks of 8 values c = 8·lane + 256·i of m, held in registers while it dots them with the gate
//          and up rows; simd_sum, then h = silu(g)·u. moe_down_q{4,8}: threadgroup = 16 output rows × token,
//          4 simdgroups × 4 rows; a simdgroup computes its rows completely: for each slot in order (routed, then
//          shared) the lanes dot their blocks of h[t, j] with W_down[e_j] rows, weight the partial by ŵ or γ,
//          and one simd_sum per row ends it: no atomics, a fixed order.
//          Prefill: the sort, with the switch moe_sort_scan (the CUDA one's port) moe_sort_scan (one threadgroup
//          of 1024 threads: histogram by threadgroup atomics, simd prefix scan over the experts = offsets, cursor
//          scatter), without it moe_hist (tile of 256 pairs per threadgroup: each pair's rank among the earlier
//          pairs of its expert in the simdgroup by 32 simd_shuffles, per-simdgroup counts in threadgroup memory,
//          the tile's histogram) → moe_scan (one threadgroup, thread e: the running sum of expert e over the
//          tiles, then a simd prefix scan over experts = offsets) → moe_scatter (the same ranks: pair p = t·k + j
//          lands at offsets[e] + tile_base[tile, e] + rank, so each expert's rows are in increasing p) → moe_gemm
//          gate+up, moe_gemm down (qmm.metal) → shared expert by qmm, moe_swiglu, qmm → moe_combine (thread
//          per output, Σ_j ŵ·yd[pos] in slot order, then γ·s).
// Checks   (launcher: backend/checks.h check_moe, then these kernels' own) bits 4/8; group % 8 == 0 and
//          K % group == 0 (a block of 8 codes stays in one group); H, I, IS % 8 == 0; 1 ≤ top_k ≤ min(E, 32);
//          E ≤ 256; m and out 16-byte aligned; 32-bit indices suffice.
//          Decode also needs one bit width for gate/up/shared gate/up and one for down/shared down (else prefill).
// Ref      cpu/moe.cpp · Test tests/ops/cases.py op="moe" via tests/metal · Launcher csrc/backend/metal/moe.cpp
// History  v1 (this); v1 + moe_sort_scan (the CUDA switch of the same name, ported: one dispatch instead of three for
//          the sort; not yet timed on Apple hardware, where the three-dispatch sort it replaces was already one pass
//          over the pairs, unlike CUDA's pass per expert)
#include "common.h"
#include "moe_args.h"

// ---- helpers --------------------------------------------------------------------------------------------------

// 8 bf16 values at p (16-byte aligned) → x[0, 8); returns Σ x.
inline float load_bf16x8(device const ushort* p, thread float* x) {
  const uint4 v = *((device const uint4*)p);
  x[0] = as_type<float>(v.x << 16);
  x[1] = as_type<float>(v.x & 0xffff0000u);
  x[2] = as_type<float>(v.y << 16);
  x[3] = as_type<float>(v.y & 0xffff0000u);
  x[4] = as_type<float>(v.z << 16);
  x[5] = as_type<float>(v.z & 0xffff0000u);
  x[6] = as_type<float>(v.w << 16);
  x[7] = as_type<float>(v.w & 0xffff0000u);
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) s += x[i];
  return s;
}

// 8 fp32 values at p → x[0, 8); returns Σ x.
inline float load_f32x8(device const float* p, thread float* x) {
  float s = 0.0f;
  for (int i = 0; i < 8; ++i) {
    x[i] = p[i];
    s += x[i];
  }
  return s;
}

// Dot of the 8 codes c .. c+7 of a row (c % 8 == 0, one group: scale s, bias b) with x, whose sum is xs:
// Σ (s·q_i + b)·x_i = s·Σ q_i·x_i + b·xs.
template <int BITS>
inline float qdot8(device const uint* row, int c, float s, float b, thread const float* x, float xs) {
  float acc = 0.0f;
  if (BITS == 4) {
    const uint w = row[c / 8];
    for (int i = 0; i < 8; ++i) acc = fma(code<4>(w, i), x[i], acc);
  } else {
    const uint w0 = row[c / 4], w1 = row[c / 4 + 1];
    for (int i = 0; i < 4; ++i) acc = fma(code<8>(w0, i), x[i], acc);
    for (int i = 0; i < 4; ++i) acc = fma(code<8>(w1, i), x[4 + i], acc);
  }
  return s * acc + b * xs;
}

// Scale and bias of code c of row n (of the whole stack) of a matrix with gpr groups per row.
inline float group_scale(device const ushort* s, uint n, int gpr, int c, int group) {
  return bf16_to_float(s[n * uint(gpr) + uint(c / group)]);
}

// ---- routing (both paths) -------------------------------------------------------------------------------------

// Simdgroup-wide: P = softmax(lr[0, E)), then `rounds` rounds of the top-k (the largest remaining P, then the lowest
// id holding it; the winner is marked -1). Lane j < rounds keeps round j's P and id in mine, mine_id; topsum is
// Σ of the winners' P in descending P, as the reference sums it. Returns the last round's winner (every lane).
inline uint route_simd(device const float* lr, int E, int rounds, uint lane, thread float& mine, thread uint& mine_id,
                       thread float& topsum) {
  constexpr int kPer = MOE_MAX_EXPERTS / 32;
  float p[kPer];
  float mx = -INFINITY;
  for (int i = 0; i < kPer; ++i) {
    const int e = int(lane) + 32 * i;
    p[i] = e < E ? lr[e] : -INFINITY;
    mx = max(mx, p[i]);
  }
  mx = simd_max(mx);
  float sum = 0.0f;
  for (int i = 0; i < kPer; ++i) {
    p[i] = int(lane) + 32 * i < E ? exp(p[i] - mx) : 0.0f;  // exp(ℓ − max ℓ)
    sum += p[i];
  }
  sum = simd_sum(sum);
  for (int i = 0; i < kPer; ++i) p[i] = int(lane) + 32 * i < E ? p[i] / sum : -1.0f;  // P; -1: not a candidate
  mine = 0.0f;
  mine_id = 0;
  topsum = 0.0f;
  uint win = 0;
  for (int j = 0; j < rounds; ++j) {
    float v = -2.0f;
    uint id = 0;
    for (int i = 0; i < kPer; ++i)
      if (p[i] > v) {  // ids ascend with i: strict > keeps the lower id of a tie
        v = p[i];
        id = lane + 32u * uint(i);
      }
    const float best = simd_max(v);
    win = simd_min(v == best ? id : 0xffffffffu);
    if (int(lane) == j) {
      mine = best;
      mine_id = win;
    }
    topsum += best;
    for (int i = 0; i < kPer; ++i)
      if (lane + 32u * uint(i) == win) p[i] = -1.0f;
  }
  return win;
}

// Simdgroup-wide: the token's k routed ids and weights ŵ (lane j < k writes slot j of ids, wts).
inline void route_write(device const float* lr, int E, int k, bool norm_topk, uint lane, device int* ids,
                        device float* wts) {
  float mine, topsum;
  uint mine_id;
  route_simd(lr, E, k, lane, mine, mine_id, topsum);
  if (int(lane) < k) {
    ids[int(lane)] = int(mine_id);
    wts[int(lane)] = norm_topk ? mine / topsum : mine;  // ŵ = P / Σ_topk P
  }
}

// Switch route_logits: the top-k picked on the logits ℓ instead of P = softmax(ℓ). The softmax keeps their order, so
// the picks are route_simd's except where two distinct logits round to one probability (there the larger logit wins).
// A round takes each lane's largest remaining key by a three-level tree (the left operand holds the lower index, so
// strict > keeps it on a tie) instead of a chain over its candidates, then the simdgroup's maximum and the lowest id
// holding it; the winner's key becomes 0, below every logit's (-inf's key is 0x007fffff). Returns the winner's id.
inline uint logit_key(float f) {
  const uint b = as_type<uint>(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
inline float key_logit(uint k) { return as_type<float>((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k); }

inline uint pick_round(thread uint* u, uint lane, thread uint& best) {
  static_assert(MOE_MAX_EXPERTS / 32 == 8, "pick_round: a tree over 8 candidates per lane");
  uint a0 = u[0], a1 = u[2], a2 = u[4], a3 = u[6];
  uint i0 = 0u, i1 = 2u, i2 = 4u, i3 = 6u;
  if (u[1] > a0) { a0 = u[1]; i0 = 1u; }
  if (u[3] > a1) { a1 = u[3]; i1 = 3u; }
  if (u[5] > a2) { a2 = u[5]; i2 = 5u; }
  if (u[7] > a3) { a3 = u[7]; i3 = 7u; }
  if (a1 > a0) { a0 = a1; i0 = i1; }
  if (a3 > a2) { a2 = a3; i2 = i3; }
  if (a2 > a0) { a0 = a2; i0 = i2; }
  best = simd_max(a0);
  const uint win = simd_min(a0 == best ? lane + 32u * i0 : 0xffffffffu);
  for (int i = 0; i < 8; ++i)
    if (lane + 32u * uint(i) == win) u[i] = 0u;
  return win;
}

// Switch route_logits: the expert of round rounds − 1 (slot rounds − 1) of the logits lr[0, E).
inline uint pick_expert(device const float* lr, int E, int rounds, uint lane) {
  uint u[MOE_MAX_EXPERTS / 32];
  for (int i = 0; i < MOE_MAX_EXPERTS / 32; ++i) {
    const int e = int(lane) + 32 * i;
    u[i] = logit_key(e < E ? lr[e] : -INFINITY);
  }
  uint best, win = 0u;
  for (int j = 0; j < rounds; ++j) win = pick_round(u, lane, best);
  return win;
}

// Switch route_logits: route_write's outputs from pick_round's picks; the picked experts' P computed as route_simd
// computes it (the same max, sum and division), Σ_topk P added in slot order.
inline void pick_write(device const float* lr, int E, int k, bool norm_topk, uint lane, device int* ids,
                       device float* wts) {
  constexpr int kPer = MOE_MAX_EXPERTS / 32;
  float l[kPer];
  uint u[kPer];
  for (int i = 0; i < kPer; ++i) {
    const int e = int(lane) + 32 * i;
    l[i] = e < E ? lr[e] : -INFINITY;
    u[i] = logit_key(l[i]);
  }
  float mx = 0.0f, mine = 0.0f;
  uint mine_id = 0u, best;
  for (int j = 0; j < k; ++j) {
    const uint win = pick_round(u, lane, best);
    const float v = key_logit(best);
    if (j == 0) mx = v;  // the first pick is the largest logit
    if (int(lane) == j) {
      mine = v;
      mine_id = win;
    }
  }
  float sum = 0.0f;
  for (int i = 0; i < kPer; ++i) sum += int(lane) + 32 * i < E ? exp(l[i] - mx) : 0.0f;
  sum = simd_sum(sum);
  const float P = exp(mine - mx) / sum;
  float topsum = 0.0f;
  for (int j = 0; j < k; ++j) topsum += simd_shuffle(P, ushort(j));
  if (int(lane) < k) {
    ids[int(lane)] = int(mine_id);
    wts[int(lane)] = norm_topk ? P / topsum : P;
  }
}

// Simdgroup-wide: γ = σ(mr·w_seg); lane owns the blocks of 8 values c = 8·lane + 256·i.
template <int SEG_BITS>
inline float seg_gate(device const ushort* mr, int H, device const uint* seg_w, device const ushort* seg_s,
                      device const ushort* seg_b, int seg_group, uint lane) {
  float dot = 0.0f;
  for (int c = 8 * int(lane); c < H; c += 256) {
    float x[8];
    const float xs = load_bf16x8(mr + c, x);
    const int g = c / seg_group;
    dot += qdot8<SEG_BITS>(seg_w, c, bf16_to_float(seg_s[g]), bf16_to_float(seg_b[g]), x, xs);
  }
  return sigmoid_f(simd_sum(dot));
}

// Simdgroup sg of threadgroup tg routes token t: P = softmax(logits[t]), the top-k (ties → lower id) with their
// weights ŵ, and γ = σ(m[t]·w_seg).
template <int SEG_BITS>
[[kernel]] void moe_route(
    constant MoeRouteArgs& a [[buffer(0)]],
    device const float* logits [[buffer(1)]],
    device const ushort* m [[buffer(2)]],
    device const uint* seg_w [[buffer(3)]],
    device const ushort* seg_s [[buffer(4)]],
    device const ushort* seg_b [[buffer(5)]],
    device int* ids [[buffer(6)]],
    device float* wts [[buffer(7)]],
    device float* gamma [[buffer(8)]],
    uint tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const int t = int(tg) * MOE_ROUTE_TOKENS + int(sg);
  if (t >= a.T) return;  // the whole simdgroup; no threadgroup barrier in this kernel
  route_write(logits + t * a.E, a.E, a.k, a.norm_topk != 0, lane, ids + t * a.k, wts + t * a.k);
  const float g = seg_gate<SEG_BITS>(m + t * a.H, a.H, seg_w, seg_s, seg_b, a.seg_group, lane);
  if (lane == 0) gamma[t] = g;
}

// ---- decode: T ≤ kQmvMaxT ---------------------------------------------------------------------------------------

// Threadgroup (slot j, tile) of token tg.y; slot j < k is routed expert ids[t, j], slot k the shared expert.
// Simdgroup sg computes rows n0 .. n0+3 of the slot's gate and up matrices: h[t, j, n] = silu(gate_n·m)·(up_n·m).
// A row past N is read clamped and not stored.
// Switch route_fused (a.route_fused): no moe_route dispatch before this one; a routed simdgroup finds ids[t, j] from
// the router logits (route_simd up to round j: the same operations, so every simdgroup agrees), and threadgroup 0 of
// token t writes the token's routing (simdgroup 0: ids, ŵ) and γ (simdgroup 1) for moe_down. Switch route_logits
// (a.pick_logits, with it): pick_expert and pick_write instead, the same picks on the logits without the softmax.
template <int BITS>
[[kernel]] void moe_gate_up(
    constant MoeDecodeArgs& a [[buffer(0)]],
    device const ushort* m [[buffer(1)]],
    device int* ids [[buffer(2)]],
    device const uint* gate_w [[buffer(3)]],
    device const ushort* gate_s [[buffer(4)]],
    device const ushort* gate_b [[buffer(5)]],
    device const uint* up_w [[buffer(6)]],
    device const ushort* up_s [[buffer(7)]],
    device const ushort* up_b [[buffer(8)]],
    device const uint* sgate_w [[buffer(9)]],
    device const ushort* sgate_s [[buffer(10)]],
    device const ushort* sgate_b [[buffer(11)]],
    device const uint* sup_w [[buffer(12)]],
    device const ushort* sup_s [[buffer(13)]],
    device const ushort* sup_b [[buffer(14)]],
    device float* h [[buffer(15)]],
    device const float* logits [[buffer(16)]],
    device float* wts [[buffer(17)]],
    device float* gamma [[buffer(18)]],
    device const uint* seg_w [[buffer(19)]],
    device const ushort* seg_s [[buffer(20)]],
    device const ushort* seg_b [[buffer(21)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int R = MOE_DECODE_ROWS;
  const int t = int(tg.y), j = int(tg.x) / a.tiles, tile = int(tg.x) % a.tiles;
  const bool shared = j == a.k;
  const int N = shared ? a.IS : a.I;
  const int n0 = (tile * MOE_DECODE_SIMDGROUPS + int(sg)) * R;
  if (n0 >= N) return;  // the whole simdgroup; no threadgroup barrier in this kernel
  if (a.route_fused && tg.x == 0 && sg < 2) {  // the token's routing and γ, for moe_down
    device const ushort* mt = m + t * a.H;
    if (sg == 0 && a.pick_logits)
      pick_write(logits + t * a.E, a.E, a.k, a.norm_topk != 0, lane, ids + t * a.k, wts + t * a.k);
    else if (sg == 0)
      route_write(logits + t * a.E, a.E, a.k, a.norm_topk != 0, lane, ids + t * a.k, wts + t * a.k);
    else {
      const float g = a.seg_bits == 8 ? seg_gate<8>(mt, a.H, seg_w, seg_s, seg_b, a.seg_group, lane)
                                      : seg_gate<4>(mt, a.H, seg_w, seg_s, seg_b, a.seg_group, lane);
      if (lane == 0) gamma[t] = g;
    }
  }
  uint e = 0u;
  if (!shared && a.route_fused && a.pick_logits) {
    e = pick_expert(logits + t * a.E, a.E, j + 1, lane);
  } else if (!shared && a.route_fused) {
    float mine, topsum;
    uint mine_id;
    e = route_simd(logits + t * a.E, a.E, j + 1, lane, mine, mine_id, topsum);
  } else if (!shared) {
    e = uint(ids[t * a.k + j]);
  }
  device const uint* gw = shared ? sgate_w : gate_w;
  device const ushort* gs = shared ? sgate_s : gate_s;
  device const ushort* gb = shared ? sgate_b : gate_b;
  device const uint* uw = shared ? sup_w : up_w;
  device const ushort* us = shared ? sup_s : up_s;
  device const ushort* ub = shared ? sup_b : up_b;
  const int ggroup = shared ? a.sgate_group : a.gate_group, ugroup = shared ? a.sup_group : a.up_group;
  const int wpr = a.H * BITS / 32, ggpr = a.H / ggroup, ugpr = a.H / ugroup;

  uint rows[R];
  for (int r = 0; r < R; ++r) rows[r] = e * uint(N) + uint(min(n0 + r, N - 1));
  float g[R], u[R];
  for (int r = 0; r < R; ++r) g[r] = u[r] = 0.0f;
  device const ushort* mr = m + t * a.H;
  for (int c = 8 * int(lane); c < a.H; c += 256) {
    float x[8];
    const float xs = load_bf16x8(mr + c, x);
    for (int r = 0; r < R; ++r) {
      const uint n = rows[r];
      g[r] += qdot8<BITS>(gw + n * uint(wpr), c, group_scale(gs, n, ggpr, c, ggroup),
                          group_scale(gb, n, ggpr, c, ggroup), x, xs);
      u[r] += qdot8<BITS>(uw + n * uint(wpr), c, group_scale(us, n, ugpr, c, ugroup),
                          group_scale(ub, n, ugpr, c, ugroup), x, xs);
    }
  }
  device float* hr = h + (t * (a.k + 1) + j) * a.hs;
  for (int r = 0; r < R; ++r) {
    const float gn = simd_sum(g[r]), un = simd_sum(u[r]);
    if (lane == 0 && n0 + r < N) hr[n0 + r] = silu_f(gn) * un;  // silu(W_gate·m) ⊙ (W_up·m)
  }
}

// Threadgroup = 16 output rows of token tg.y; simdgroup sg computes rows n0 .. n0+3 completely: for each slot j in
// order (routed experts, then the shared one) the lanes dot their blocks of h[t, j] with the rows of W_down[e_j]
// (or W_sd), the partial is weighted by ŵ[t, j] (or γ_t), and one simd_sum per row ends the sum.
template <int BITS>
[[kernel]] void moe_down(
    constant MoeDecodeArgs& a [[buffer(0)]],
    device const float* h [[buffer(1)]],
    device const int* ids [[buffer(2)]],
    device const float* wts [[buffer(3)]],
    device const float* gamma [[buffer(4)]],
    device const uint* down_w [[buffer(5)]],
    device const ushort* down_s [[buffer(6)]],
    device const ushort* down_b [[buffer(7)]],
    device const uint* sdown_w [[buffer(8)]],
    device const ushort* sdown_s [[buffer(9)]],
    device const ushort* sdown_b [[buffer(10)]],
    device ushort* out [[buffer(11)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int R = MOE_DECODE_ROWS;
  const int t = int(tg.y);
  const int n0 = (int(tg.x) * MOE_DECODE_SIMDGROUPS + int(sg)) * R;
  if (n0 >= a.H) return;  // the whole simdgroup; no threadgroup barrier in this kernel
  float acc[R];
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int j = 0; j <= a.k; ++j) {
    const bool shared = j == a.k;
    const int K = shared ? a.IS : a.I, group = shared ? a.sdown_group : a.down_group;
    const uint e = shared ? 0u : uint(ids[t * a.k + j]);
    const float wj = shared ? gamma[t] : wts[t * a.k + j];
    device const uint* dw = shared ? sdown_w : down_w;
    device const ushort* ds = shared ? sdown_s : down_s;
    device const ushort* db = shared ? sdown_b : down_b;
    const int wpr = K * BITS / 32, gpr = K / group;
    device const float* hr = h + (t * (a.k + 1) + j) * a.hs;
    float part[R];
    for (int r = 0; r < R; ++r) part[r] = 0.0f;
    for (int c = 8 * int(lane); c < K; c += 256) {
      float x[8];
      const float xs = load_f32x8(hr + c, x);
      for (int r = 0; r < R; ++r) {
        const uint n = e * uint(a.H) + uint(min(n0 + r, a.H - 1));
        part[r] += qdot8<BITS>(dw + n * uint(wpr), c, group_scale(ds, n, gpr, c, group),
                               group_scale(db, n, gpr, c, group), x, xs);
      }
    }
    for (int r = 0; r < R; ++r) acc[r] += wj * part[r];  // ŵ_e·y_e[n], or γ·s[n]
  }
  for (int r = 0; r < R; ++r) {
    const float v = simd_sum(acc[r]);
    if (lane == 0 && n0 + r < a.H) out[t * a.H + n0 + r] = float_to_bf16(v);
  }
}

// ---- prefill: the expert-sorted order of the (token, slot) pairs -------------------------------------------------

// For the tile's pair of this thread (expert id; id ≥ E for a pair past P): returns its rank among the earlier
// pairs of the same expert in its simdgroup, and leaves in cnt[s·MOE_MAX_EXPERTS + e] the number of pairs of
// expert e in simdgroup s. Every thread of the threadgroup calls it (it holds two barriers).
inline uint tile_rank(uint id, int E, uint tid, uint sg, uint lane, threadgroup uint* cnt) {
  for (uint i = tid; i < uint(MOE_SORT_TILE / 32 * MOE_MAX_EXPERTS); i += MOE_SORT_TILE) cnt[i] = 0u;
  uint before = 0, same = 0;
  for (uint l = 0; l < 32; ++l) {
    const uint other = simd_shuffle(id, l);
    before += (l < lane && other == id) ? 1u : 0u;
    same += other == id ? 1u : 0u;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (id < uint(E) && before + 1 == same) cnt[sg * MOE_MAX_EXPERTS + id] = same;  // the last pair of its expert
  threadgroup_barrier(mem_flags::mem_threadgroup);
  return before;
}

// Threadgroup = tile tg of MOE_SORT_TILE pairs: tile_counts[tg, e] = pairs of expert e in the tile.
[[kernel]] void moe_hist(
    constant MoeSortArgs& a [[buffer(0)]],
    device const int* ids [[buffer(1)]],
    device int* tile_counts [[buffer(2)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint cnt[MOE_SORT_TILE / 32 * MOE_MAX_EXPERTS];
  const int p = int(tg) * MOE_SORT_TILE + int(tid);
  const uint id = p < a.P ? uint(ids[p]) : uint(a.E);
  tile_rank(id, a.E, tid, sg, lane, cnt);
  if (int(tid) < a.E) {
    uint c = 0;
    for (int s = 0; s < MOE_SORT_TILE / 32; ++s) c += cnt[s * MOE_MAX_EXPERTS + int(tid)];
    tile_counts[int(tg) * a.E + int(tid)] = int(c);
  }
}

// One threadgroup of MOE_MAX_EXPERTS threads, thread e = expert e: tile_base[tile, e] = pairs of expert e in the
// tiles before; offsets[e] = pairs routed to experts < e (simd prefix scan, then the simdgroups' totals);
// offsets[E] = P.
[[kernel]] void moe_scan(
    constant MoeSortArgs& a [[buffer(0)]],
    device const int* tile_counts [[buffer(1)]],
    device int* tile_base [[buffer(2)]],
    device int* offsets [[buffer(3)]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup int sg_total[MOE_MAX_EXPERTS / 32];
  const int e = int(tid);
  int run = 0;
  if (e < a.E)
    for (int tile = 0; tile < a.tiles; ++tile) {
      tile_base[tile * a.E + e] = run;
      run += tile_counts[tile * a.E + e];
    }
  const int below_in_sg = simd_prefix_exclusive_sum(run), sg_sum = simd_sum(run);
  if (lane == 0) sg_total[sg] = sg_sum;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  int below = below_in_sg;
  for (uint s = 0; s < sg; ++s) below += sg_total[s];
  if (e < a.E) offsets[e] = below;
  if (e == a.E - 1) offsets[a.E] = below + run;
}

// Threadgroup = tile tg: pair p = t·k + j of expert e lands at r = offsets[e] + tile_base[tg, e] + (its rank in the
// tile), so each expert's rows keep increasing p; rows[r] = t, pos[p] = r.
[[kernel]] void moe_scatter(
    constant MoeSortArgs& a [[buffer(0)]],
    device const int* ids [[buffer(1)]],
    device const int* tile_base [[buffer(2)]],
    device const int* offsets [[buffer(3)]],
    device int* rows [[buffer(4)]],
    device int* pos [[buffer(5)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup uint cnt[MOE_SORT_TILE / 32 * MOE_MAX_EXPERTS];
  const int p = int(tg) * MOE_SORT_TILE + int(tid);
  const uint id = p < a.P ? uint(ids[p]) : uint(a.E);
  uint rank = tile_rank(id, a.E, tid, sg, lane, cnt);
  if (id < uint(a.E)) {
    for (uint s = 0; s < sg; ++s) rank += cnt[s * MOE_MAX_EXPERTS + id];
    const int r = offsets[id] + tile_base[int(tg) * a.E + int(id)] + int(rank);
    rows[r] = p / a.k;
    pos[p] = r;
  }
}

// Switch moe_sort_scan: the same offsets, rows and pos from one threadgroup of MOE_SORT_SCAN_THREADS threads, in one
// dispatch instead of three: a histogram of the expert ids in threadgroup memory (atomic adds), an exclusive scan over
// the experts (simdgroup 0, MOE_MAX_EXPERTS / 32 experts per lane) that gives offsets, then each pair p = t·k + j takes
// the next free row of its expert through a threadgroup cursor: rows[r] = t, pos[p] = r. The order of an expert's
// rows then depends on the order the threads run in; every row is computed on its own (moe_gemm) and the combine
// reads each pair's row through pos, so no output does.
[[kernel]] void moe_sort_scan(
    constant MoeSortArgs& a [[buffer(0)]],
    device const int* ids [[buffer(1)]],
    device int* offsets [[buffer(2)]],
    device int* rows [[buffer(3)]],
    device int* pos [[buffer(4)]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  constexpr int kPer = MOE_MAX_EXPERTS / 32;
  threadgroup atomic_int count[MOE_MAX_EXPERTS];
  threadgroup atomic_int cursor[MOE_MAX_EXPERTS];
  for (int e = int(tid); e < a.E; e += MOE_SORT_SCAN_THREADS) atomic_store_explicit(&count[e], 0, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int p = int(tid); p < a.P; p += MOE_SORT_SCAN_THREADS)
    atomic_fetch_add_explicit(&count[ids[p]], 1, memory_order_relaxed);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {  // exclusive scan: lane l owns experts kPer·l .. kPer·l + kPer − 1
    int v[kPer], own = 0;
    for (int i = 0; i < kPer; ++i) {
      const int e = int(lane) * kPer + i;
      v[i] = e < a.E ? atomic_load_explicit(&count[e], memory_order_relaxed) : 0;
      own += v[i];
    }
    int run = simd_prefix_exclusive_sum(own);
    for (int i = 0; i < kPer; ++i) {
      const int e = int(lane) * kPer + i;
      if (e < a.E) {
        atomic_store_explicit(&cursor[e], run, memory_order_relaxed);
        offsets[e] = run;
      }
      run += v[i];
    }
    if (lane == 31) offsets[a.E] = run;  // = P
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int p = int(tid); p < a.P; p += MOE_SORT_SCAN_THREADS) {
    const int r = atomic_fetch_add_explicit(&cursor[ids[p]], 1, memory_order_relaxed);
    rows[r] = p / a.k;
    pos[p] = r;
  }
}

// ---- prefill: shared expert and combine --------------------------------------------------------------------------

// h[i] = silu(g[i])·u[i] (the shared expert's SwiGLU; g, u f32 from qmm).
[[kernel]] void moe_swiglu(
    constant MoeSwigluArgs& a [[buffer(0)]],
    device const float* g [[buffer(1)]],
    device const float* u [[buffer(2)]],
    device ushort* h [[buffer(3)]],
    uint i [[thread_position_in_grid]]) {
  if (int(i) < a.n) h[i] = float_to_bf16(silu_f(g[i]) * u[i]);
}

// out[t, n] = Σ_j ŵ[t, j]·yd[pos[t, j], n] (slot order) + γ_t·s[t, n]; thread = one n of token tg.y.
[[kernel]] void moe_combine(
    constant MoeCombineArgs& a [[buffer(0)]],
    device const ushort* yd [[buffer(1)]],
    device const ushort* s [[buffer(2)]],
    device const int* pos [[buffer(3)]],
    device const float* wts [[buffer(4)]],
    device const float* gamma [[buffer(5)]],
    device ushort* out [[buffer(6)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  const int t = int(tg.y), n = int(tg.x) * MOE_ELEMENT_THREADS + int(tid);
  if (n >= a.H) return;  // no barrier in this kernel
  float acc = 0.0f;
  for (int j = 0; j < a.k; ++j)
    acc = fma(wts[t * a.k + j], bf16_to_float(yd[pos[t * a.k + j] * a.H + n]), acc);  // + ŵ_e·y_e
  acc = fma(gamma[t], bf16_to_float(s[t * a.H + n]), acc);                          // + γ·s
  out[t * a.H + n] = float_to_bf16(acc);
}

template [[host_name("moe_route_s4")]] [[kernel]] decltype(moe_route<4>) moe_route<4>;
template [[host_name("moe_route_s8")]] [[kernel]] decltype(moe_route<8>) moe_route<8>;
template [[host_name("moe_gate_up_q4")]] [[kernel]] decltype(moe_gate_up<4>) moe_gate_up<4>;
template [[host_name("moe_gate_up_q8")]] [[kernel]] decltype(moe_gate_up<8>) moe_gate_up<8>;
template [[host_name("moe_down_q4")]] [[kernel]] decltype(moe_down<4>) moe_down<4>;
template [[host_name("moe_down_q8")]] [[kernel]] decltype(moe_down<8>) moe_down<8>;
