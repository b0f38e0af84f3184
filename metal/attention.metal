// attention.metal: the gated full-attention mixer (architecture.md §4, §3.4): q/k RMSNorm, partial RoPE, K/V cache
// append, causal GQA softmax attention with the query heads of a kv head packed into one threadgroup, a fixed-block
// split of the keys for long contexts, and the sigmoid output gate.
//
// Math     per token t (position p = pos0 + t) and head h (kv head h / G, G = NH/NKV):
//            q, g = qg[t, h, :HD], qg[t, h, HD:];  q ← RMSNorm(q; q_norm), k ← RMSNorm(k; k_norm)   (eps a.eps)
//            RoPE on dims i < R with pairs (i, i+R/2): θ_i = theta^(−2i/R) (host powf), angle = float(p)·θ_i
//            K[p], V[p] ← k, v (bf16);  o = softmax(q·K[0..p]ᵀ / sqrt(HD)) · V[0..p];  out = o ⊙ σ(g)
//          Online softmax in the log2 domain: s = q·k·(HD^-1/2·log2 e), m = running max, l = Σ 2^(s−m),
//          O = Σ 2^(s−m)·v; key blocks combine as O = Σ_b 2^(m_b−M)·O_b / Σ_b 2^(m_b−M)·l_b.
// Layout   qg bf16[T, NH, 2·HD]; k, v bf16[T, NKV·HD]; caches bf16[cap, NKV, HD]; q_norm, k_norm fp32[HD];
//          out bf16[T, NH·HD]; pos int32[1] (a.pos_dev, or pos0 bound as bytes). Scratch: kSlotAttnQ fp32[T, NH, HD]
//          (normalised, rotated q); kSlotAttnPartial fp32 O[S, NKV, Rpad, HD] then (m, l)[S, NKV, Rpad, 2].
//          Packed rows per kv head: row r = t·G + (h mod G), so one K/V tile in threadgroup memory serves all G heads.
// Traffic  real shapes (NH=16, NKV=2, HD=256), per layer: K/V cache 2 KB per context token, read once per row tile
//          of 16 packed rows (decode: once; decode at L=4K: 8.4 MB, 128K: 268 MB); ≈ 60 KB per token for qg, k, v,
//          the fp32 q scratch (written, read) and out.
//          Prefill re-reads the keys for every 2-token row tile: 4K prompt ≈ 8.6 GB per layer, mostly from the SLC.
// Work     4·NH·HD = 16 KFLOP per (query, visible key). Decode: 8 FLOP/B, bandwidth-bound. Floor on an M3 Max
//          (400 GB/s, 14 TFLOP/s fp32): decode 8.4 MB → 21 µs at 4K, 0.67 ms at 128K per layer; prefill of a 4K
//          prompt 137 GFLOP → 9.6 ms per layer (fp32 FMA; this scalar kernel's threadgroup loads keep it below that).
// Mapping  attn_prep: one simdgroup per (token, q head or kv head), 4 per threadgroup; simd_sum for the norm; a lane
//          owns dims lane + 32u, with both dims of a rotation pair (i, i+R/2) for i < R/2. θ_i come from the host.
//          attn_main_hd<HD> (S = 1) / attn_split_hd<HD> (S > 1): grid (row tiles, NKV, S), 128 threads. A threadgroup
//          owns BM packed rows of one kv head (attn_bm: 16 at HD=256, else 32; the decode tile _r8, switch
//          attn_decode_tile: 8, which a token's G = 8 heads fill) and one key block; Q sits in threadgroup memory
//          (fp32, pre-scaled), key tiles of BC keys (attn_bc: 8/16/32; 16 for _r8) of K and V as bf16 (K rows
//          padded by 8 bytes against bank conflicts). Per tile, Q·Kᵀ: thread (key j = tid mod BC, rows tid/BC +
//          i·128/BC) scores its key against its rows and stores the masked scores; then P·V: thread (row tid/TPR,
//          float4 chunks tr + TPR·u of O, TPR = 128/BM) takes its row's max over the tile, rescales its O chunks and
//          accumulates 2^(s−m)·V. Two barriers per tile; the next K tile loads during P·V. Late row tiles start
//          first. Masked scores hold a finite sentinel (no ∞ arithmetic, safe under fast math); a row with nothing
//          visible yet keeps p = 0.
//          Split (launcher): with ≥ 32K keys, or > 512 keys and under 64 threadgroups, key block z covers a.block
//          keys (fixed: 512, doubled until the partials fit in 64 MB); S = ⌈keys/block⌉ with keys = pos0 + T, or
//          cache_cap when the position comes from the device; blocks past the live keys exit at once.
//          attn_sg_hd<HD> / attn_sg_split_hd<HD> (switch attn_simdgroup; the launcher takes them from 32 packed rows
//          per kv head, T·G ≥ ATTN_SG_MIN_ROWS, so decode keeps the scalar kernel): the same grid, splits and partials
//          with row tiles of BM = 32 and 256 threads. Simdgroup sg owns rows 8·(sg/2) .. +7 and head-dim half sg % 2:
//          its q half stays in HD/16 simdgroup_float8x8 for the whole call, its O half in HD/16 accumulators. A key
//          tile (attn_sg_bc: 8 keys at HD = 256, 16 at 128, 32 below) is staged as fp32 Kᵀ and V; each simdgroup
//          multiplies its q half into the scores' half-sums, then runs the online softmax for 4 of its block's rows
//          (8 lanes a row: the two halves added, masked, max and sum by xor shuffles), and last rescales its O by
//          diag(α) (one 8×8 product per accumulator, skipped when no max of the block moved) and adds P·V. Four
//          barriers per tile. Products and sums in fp32, as the scalar kernel: only the order of additions differs.
//          attn_combine: one threadgroup per (t, h), thread = (float4 column, group of blocks); online within a
//          thread, then across groups through threadgroup memory, in a fixed order; applies σ(gate).
// Checks   (launcher) NH % NKV == 0; HD ∈ {32, 64, 128, 256}; rotary_dim even, ≤ HD; pos0 + T ≤ cache_cap; caches
//          8-byte aligned; indices fit in int. Kernels clamp rows to cache_cap, so a stale device position never
//          writes or reads past the caches. RoPE angles reach 2.6·10^5 rad: reduced mod 2π in float with an exact
//          two-constant Cody–Waite step before precise::cos/sin.
// Ref      cpu/attention.cpp · Test tests/metal/test_metal_ops.py (op "attention", cases in tests/ops/cases.py)
// History  v1: scalar fp32 tiles in threadgroup memory (the CPU harness runs it at reference cost).
//          v2 (2026-12-05): prefill's products on simdgroup_float8x8 (attn_sg, switch attn_simdgroup). Per tile and
//          simdgroup at HD = 256: 16 + 16 products of 8×8×8 (+ 16 for a moved max) against 4 barriers and 32 staged
//          elements per thread. Decode on a tile of 8 rows (attn_decode_tile): the prefill tile of 16 rows at
//          HD = 256 scored and accumulated 8 padding rows for a token's 8 heads, twice the work per key. Neither
//          version is timed on Apple hardware yet (benchmarks/NOTES.md, Metal).
#include "common.h"
#include "attention_args.h"

#define MASKED (-3.0e38f)  // score of a key a row must not see

// 4 bf16 (2 words, element 0 in the low half of x) → float4.
inline float4 bf16x4(uint2 w) {
  return float4(as_type<float>(w.x << 16), as_type<float>(w.x & 0xffff0000u), as_type<float>(w.y << 16),
                as_type<float>(w.y & 0xffff0000u));
}

// (cos a, sin a) for 0 ≤ a < 2^18 (positions below 262144 at θ_0 = 1), reduced to [−π, π] first: a < π keeps k = 0;
// above, a and k·C1 are multiples of 2^-22 and |a − k·C1| < 4, so the first fma is exact; the second adds k·(2π − C1)
// with one rounding (≤ 2.4e-7 absolute).
inline float2 rope_cos_sin(float a) {
  const float k = float(int(a * 0.159154943f + 0.5f));
  float r = fma(-k, 6.28318548f, a);   // C1 = float(2π)
  r = fma(-k, -1.74845553e-7f, r);     // 2π − C1
  return float2(precise::cos(r), precise::sin(r));
}

// ---- attn_prep: norm + RoPE + cache append -----------------------------------------------------------------------
// Element i of a normalised, rotated head: q in fp32, k into its cache row as bf16.
inline void attn_put(bool is_q, device float* qd, device ushort* kd, int i, float y) {
  if (is_q)
    qd[i] = y;
  else
    kd[i] = float_to_bf16(y);
}

// Simdgroup item = tg·4 + sg handles j = item mod (NH+NKV) of token t = item / (NH+NKV): j < NH is q head j (written to
// q fp32), else kv head j − NH (k normalised and rotated into the K cache, v copied into the V cache). A lane owns
// both dims of each of its rotation pairs, so the only exchange is the norm's simd_sum.
[[kernel]] void attn_prep(
    constant AttnPrepArgs& args [[buffer(0)]],
    device const int* pos [[buffer(1)]],
    device const ushort* qg [[buffer(2)]],
    device const ushort* k [[buffer(3)]],
    device const ushort* v [[buffer(4)]],
    device const float* q_norm [[buffer(5)]],
    device const float* k_norm [[buffer(6)]],
    device ushort* k_cache [[buffer(7)]],
    device ushort* v_cache [[buffer(8)]],
    device float* q [[buffer(9)]],
    uint tg [[threadgroup_position_in_grid]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  const int HD = args.HD, R = args.R, half = args.R / 2, per_t = args.NH + args.NKV;
  const int item = int(tg) * ATTN_PREP_SG + int(sg);
  const int t = item / per_t, j = item % per_t, p = pos[0] + t;
  const bool is_q = j < args.NH;
  // Whole simdgroups: an item past the end, or a k/v row a stale device position would put outside the cache, idles
  // (it still takes part in the collective).
  const bool active = item < args.T * per_t && (is_q || p < args.cache_cap);
  const int h = is_q ? j : j - args.NH;
  device const ushort* src = is_q ? qg + (t * args.NH + h) * 2 * HD : k + (t * args.NKV + h) * HD;
  device const float* w = is_q ? q_norm : k_norm;

  float ss = 0.0f;
  for (int i = int(lane); i < HD && active; i += 32) {
    const float xi = bf16_to_float(src[i]);
    ss += xi * xi;
  }
  ss = simd_sum(ss);
  if (!active) return;
  const float r = 1.0f / precise::sqrt(ss / float(HD) + args.eps);  // RMSNorm: x·r·w
  device float* qd = q + (t * args.NH + h) * HD;
  device ushort* kd = k_cache + (p * args.NKV + h) * HD;
  for (int i = int(lane); i < HD; i += 32) {
    if (i >= half && i < R) continue;  // the second dim of a rotation pair: written with the first
    const float x0 = bf16_to_float(src[i]) * r * w[i];
    if (i < half) {  // rotate-half RoPE on the pair (i, i + R/2); the angle in fp32, as the reference
      const float x1 = bf16_to_float(src[i + half]) * r * w[i + half];
      const float2 cs = rope_cos_sin(float(p) * args.inv_freq[i]);
      attn_put(is_q, qd, kd, i, x0 * cs.x - x1 * cs.y);
      attn_put(is_q, qd, kd, i + half, x1 * cs.x + x0 * cs.y);
    } else {
      attn_put(is_q, qd, kd, i, x0);
    }
  }
  if (!is_q) {
    device const ushort* vs = v + (t * args.NKV + h) * HD;
    device ushort* vd = v_cache + (p * args.NKV + h) * HD;
    for (int i = int(lane); i < HD; i += 32) vd[i] = vs[i];
  }
}

// ---- attn_main / attn_split: one threadgroup = BM packed rows of one kv head × one key block ----------------------
// Loads keys key0 .. key0+BC−1 of `cache` (kv head kvh) into a [BC][LD] tile of 4-bf16 words; keys ≥ kend are zero.
template <int HD, int BC, int LD>
inline void attn_load_tile(threadgroup uint2* dst, device const ushort* cache, int key0, int kend, int NKV, int kvh,
                           uint tid) {
  constexpr int C4 = HD / 4;
  for (int i = int(tid); i < BC * C4; i += ATTN_NT) {
    const int key = key0 + i / C4, c = i % C4;
    uint2 w = uint2(0u, 0u);
    if (key < kend) w = ((device const uint2*)(cache + (key * NKV + kvh) * HD))[c];
    dst[(i / C4) * LD + c] = w;
  }
}

template <int HD, bool SPLIT, bool DEC>
inline void attn_impl(constant AttnMainArgs& a, int pos0, device const float* q, device const ushort* k_cache,
                      device const ushort* v_cache, device const ushort* qg, device ushort* out, device float* part,
                      threadgroup float4* qs, threadgroup uint2* ks, threadgroup uint2* vs, threadgroup float* ss,
                      uint3 tg, uint3 ntg, uint tid) {
  constexpr int BM = attn_bm(HD, DEC), BC = attn_bc(HD, DEC), NT = ATTN_NT, C4 = HD / 4, KLD = C4 + 1;
  static_assert(NT / BM <= C4 && BM * BC % NT == 0, "P·V: a row's threads each own a float4 of O; whole scores");
  constexpr int EPT = BM * BC / NT, RSTEP = NT / BC;  // scores per thread; row step between them
  constexpr int TPR = NT / BM, CPT = C4 / TPR;        // threads per row in P·V; float4 chunks of O per thread
  const int G = a.G, nrows = a.T * a.G, kvh = int(tg.y), split = int(tg.z);
  const int r0 = (int(ntg.x) - 1 - int(tg.x)) * BM;  // late rows see the most keys: they start first
  const int t_hi = min(a.T - 1, (r0 + BM - 1) / G);
  const int k0 = split * a.block;
  const int kend = min(min(k0 + a.block, pos0 + t_hi + 1), a.cache_cap);
  if (k0 >= kend) return;  // the whole threadgroup: this block lies past the live keys

  for (int i = int(tid); i < BM * C4; i += NT) {  // Q tile, pre-scaled into the log2 domain; zero past nrows
    const int r = r0 + i / C4;
    float4 x = float4(0.0f);
    if (r < nrows) x = ((device const float4*)(q + ((r / G) * a.NH + kvh * G + r % G) * HD))[i % C4] * a.scale_log2;
    qs[i] = x;
  }
  attn_load_tile<HD, BC, KLD>(ks, k_cache, k0, kend, a.NKV, kvh, tid);
  attn_load_tile<HD, BC, C4>(vs, v_cache, k0, kend, a.NKV, kvh, tid);

  // Q·Kᵀ role: key j of each tile, rows rb + i·RSTEP; key kt + j is visible to row r iff it is < lim (causal, block).
  const int j = int(tid) % BC, rb = int(tid) / BC;
  int lim[EPT];
  for (int i = 0; i < EPT; ++i) {
    const int r = r0 + rb + i * RSTEP;
    lim[i] = r < nrows ? min(pos0 + r / G + 1, kend) : 0;
  }
  // P·V role: row pr, float4 chunks tr + TPR·u of O (running max m and sum l of that row, kept by each of its threads).
  const int pr = int(tid) / TPR, tr = int(tid) % TPR;
  float m = MASKED, l = 0.0f;
  float4 o[CPT];
  for (int u = 0; u < CPT; ++u) o[u] = float4(0.0f);
  threadgroup_barrier(mem_flags::mem_threadgroup);

  for (int kt = k0; kt < kend; kt += BC) {
    float s[EPT];
    for (int i = 0; i < EPT; ++i) s[i] = 0.0f;
    threadgroup const uint2* kr = ks + j * KLD;
    for (int c = 0; c < C4; ++c) {
      const float4 kv = bf16x4(kr[c]);
      for (int i = 0; i < EPT; ++i) {
        const float4 qv = qs[(rb + i * RSTEP) * C4 + c];
        s[i] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;  // s = q·k·HD^-1/2·log2 e
      }
    }
    for (int i = 0; i < EPT; ++i) ss[(rb + i * RSTEP) * BC + j] = kt + j < lim[i] ? s[i] : MASKED;
    threadgroup_barrier(mem_flags::mem_threadgroup);  // scores visible; the K tile is free

    const bool more = kt + BC < kend;
    if (more) attn_load_tile<HD, BC, KLD>(ks, k_cache, kt + BC, kend, a.NKV, kvh, tid);
    threadgroup const float* sr = ss + pr * BC;
    float mx = m;
    for (int jj = 0; jj < BC; ++jj) mx = max(mx, sr[jj]);
    const float alpha = exp2(m - mx);  // 0 when m was the sentinel and a key is visible now; 1 when nothing changed
    m = mx;
    l *= alpha;
    for (int u = 0; u < CPT; ++u) o[u] *= alpha;
    for (int jj = 0; jj < BC; ++jj) {
      const float sc = sr[jj];
      const float p = sc == MASKED ? 0.0f : exp2(sc - mx);
      l += p;
      threadgroup const uint2* vr = vs + jj * C4 + tr;
      for (int u = 0; u < CPT; ++u) o[u] += p * bf16x4(vr[TPR * u]);  // O += 2^(s−m)·v
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the V tile and the scores are free
    if (more) attn_load_tile<HD, BC, C4>(vs, v_cache, kt + BC, kend, a.NKV, kvh, tid);
  }

  const int r = r0 + pr;
  if (r >= nrows) return;
  const int row = (r / G) * a.NH + kvh * G + r % G;  // (t, h) row of qg and out
  if (SPLIT) {
    const int prow = (split * a.NKV + kvh) * a.Rpad + r;
    device float4* po = (device float4*)(part + prow * HD);
    for (int u = 0; u < CPT; ++u) po[tr + TPR * u] = o[u];
    if (tr == 0) {
      device float* ml = part + a.S * a.NKV * a.Rpad * HD + prow * 2;
      ml[0] = m;
      ml[1] = l;
    }
  } else {
    device const ushort* gate = qg + row * 2 * HD + HD;
    device ushort* dst = out + row * HD;
    for (int u = 0; u < CPT; ++u) {
      const int d = 4 * (tr + TPR * u);
      const float ov[4] = {o[u].x, o[u].y, o[u].z, o[u].w};
      for (int e = 0; e < 4; ++e) dst[d + e] = float_to_bf16(ov[e] / l * sigmoid_f(bf16_to_float(gate[d + e])));
    }
  }
}

// S == 1: the gated output directly.
template <int HD, bool DEC>
[[kernel]] void attn_main(
    constant AttnMainArgs& args [[buffer(0)]],
    device const int* pos [[buffer(1)]],
    device const float* q [[buffer(2)]],
    device const ushort* k_cache [[buffer(3)]],
    device const ushort* v_cache [[buffer(4)]],
    device const ushort* qg [[buffer(5)]],
    device ushort* out [[buffer(6)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint3 ntg [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float4 qs[attn_bm(HD, DEC) * HD / 4];
  threadgroup uint2 ks[attn_bc(HD, DEC) * (HD / 4 + 1)];
  threadgroup uint2 vs[attn_bc(HD, DEC) * HD / 4];
  threadgroup float ss[attn_bm(HD, DEC) * attn_bc(HD, DEC)];
  attn_impl<HD, false, DEC>(args, pos[0], q, k_cache, v_cache, qg, out, nullptr, qs, ks, vs, ss, tg, ntg, tid);
}

// S > 1: fp32 partials (O, m, l) of key block z, merged by attn_combine.
template <int HD, bool DEC>
[[kernel]] void attn_split(
    constant AttnMainArgs& args [[buffer(0)]],
    device const int* pos [[buffer(1)]],
    device const float* q [[buffer(2)]],
    device const ushort* k_cache [[buffer(3)]],
    device const ushort* v_cache [[buffer(4)]],
    device float* part [[buffer(5)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint3 ntg [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float4 qs[attn_bm(HD, DEC) * HD / 4];
  threadgroup uint2 ks[attn_bc(HD, DEC) * (HD / 4 + 1)];
  threadgroup uint2 vs[attn_bc(HD, DEC) * HD / 4];
  threadgroup float ss[attn_bm(HD, DEC) * attn_bc(HD, DEC)];
  attn_impl<HD, true, DEC>(args, pos[0], q, k_cache, v_cache, nullptr, nullptr, part, qs, ks, vs, ss, tg, ntg, tid);
}

// ---- attn_sg / attn_sg_split (switch attn_simdgroup): the same tiles on simdgroup matrices ----------
// Threadgroup = 8 simdgroups: simdgroup sg owns packed rows 8·(sg/2) .. +7 of the BM = 32 and head-dim half sg % 2.
// It holds its rows' q half as HD/16 matrices and its rows' O half as HD/16 accumulators for the whole key range. Per
// key tile (BC keys, staged as fp32 Kᵀ [HD][BC+4] and V [BC][HD+4]): each simdgroup multiplies its q half into the
// scores' half-sums (8 × BC) in `sp`; each simdgroup then takes 4 of its block's 8 rows (8 lanes a row, keys
// kl + 8i) for the online softmax: adds the halves, masks, the row max and sum by xor shuffles inside the 8 lanes,
// writes P over the half-0 sums and α = 2^(m_old − m_new) on the diagonal of its block's 8×8 `dg`; last the pair
// rescales its accumulators as O ← diag(α)·O (skipped when no row's max moved) and adds P·V.
template <int HD, bool SPLIT>
inline void attn_sg_impl(constant AttnMainArgs& a, int pos0, device const float* q, device const ushort* k_cache,
                         device const ushort* v_cache, device const ushort* qg, device ushort* out, device float* part,
                         threadgroup float* tile, threadgroup float* sp, threadgroup float* dg, threadgroup int* moved,
                         threadgroup float* lrow, uint3 tg, uint3 ntg, uint tid, uint sg, uint lane) {
  constexpr int BM = ATTN_SG_BM, BC = attn_sg_bc(HD), NT = ATTN_SG_NT, C4 = HD / 4, H2 = HD / 2, NQ = H2 / 8;
  constexpr int LDK = BC + 4, LDV = HD + 4, LDS = BC + 4, LDO = H2 + 4;
  threadgroup float* kt = tile;             // Kᵀ of the tile: [HD][LDK]
  threadgroup float* vt = tile + HD * LDK;  // V of the tile: [BC][LDV]
  const int G = a.G, nrows = a.T * a.G, kvh = int(tg.y), split = int(tg.z);
  const int r0 = (int(ntg.x) - 1 - int(tg.x)) * BM;  // late rows see the most keys: they start first
  const int t_hi = min(a.T - 1, (r0 + BM - 1) / G);
  const int k0 = split * a.block;
  const int kend = min(min(k0 + a.block, pos0 + t_hi + 1), a.cache_cap);
  if (k0 >= kend) return;  // the whole threadgroup: this block lies past the live keys
  const int rb = int(sg) / 2, hh = int(sg) % 2;  // row block, head-dim half
  const int rr = hh * 4 + int(lane) / 8, kl = int(lane) % 8;  // softmax role: row rr of the block, keys kl + 8i
  const int r = r0 + rb * 8 + rr;
  const int lim = r < nrows ? min(pos0 + r / G + 1, kend) : 0;  // key kt + j is visible to row r iff kt + j < lim

  for (int i = int(tid); i < 4 * 64; i += NT) dg[i] = 0.0f;  // the diagonals are written per tile, the rest stays 0
  // Q, pre-scaled into the log2 domain (zero past nrows), through `tile` one head-dim half at a time.
  simdgroup_float8x8 qm[NQ];
  for (int h = 0; h < 2; ++h) {
    for (int i = int(tid); i < BM * H2 / 4; i += NT) {
      const int rl = i / (H2 / 4), c = i % (H2 / 4), rq = r0 + rl;
      float4 x = float4(0.0f);
      if (rq < nrows)
        x = ((device const float4*)(q + ((rq / G) * a.NH + kvh * G + rq % G) * HD + h * H2))[c] * a.scale_log2;
      threadgroup float* d = tile + rl * LDO + 4 * c;
      d[0] = x.x;
      d[1] = x.y;
      d[2] = x.z;
      d[3] = x.w;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (hh == h)
      for (int d = 0; d < NQ; ++d) simdgroup_load(qm[d], tile + rb * 8 * LDO + 8 * d, LDO);
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  simdgroup_float8x8 om[NQ];
  for (int d = 0; d < NQ; ++d) om[d] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  float m = MASKED, l = 0.0f;  // the row's running max and sum (the same in its 8 lanes)
  for (int kt0 = k0; kt0 < kend; kt0 += BC) {
    // (1) The tile's keys and values as fp32 (zero past kend).
    for (int i = int(tid); i < BC * C4; i += NT) {
      const int j = i / C4, c = i % C4, key = kt0 + j;
      uint2 wk = uint2(0u, 0u), wv = uint2(0u, 0u);
      if (key < kend) {
        wk = ((device const uint2*)(k_cache + (key * a.NKV + kvh) * HD))[c];
        wv = ((device const uint2*)(v_cache + (key * a.NKV + kvh) * HD))[c];
      }
      const float4 fk = bf16x4(wk), fv = bf16x4(wv);
      kt[(4 * c) * LDK + j] = fk.x;
      kt[(4 * c + 1) * LDK + j] = fk.y;
      kt[(4 * c + 2) * LDK + j] = fk.z;
      kt[(4 * c + 3) * LDK + j] = fk.w;
      threadgroup float* vd = vt + j * LDV + 4 * c;
      vd[0] = fv.x;
      vd[1] = fv.y;
      vd[2] = fv.z;
      vd[3] = fv.w;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // (2) This half's share of the block's scores: S_hh = Q[:, half] · Kᵀ[half, :].
    for (int jb = 0; jb < BC / 8; ++jb) {
      simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
      for (int d = 0; d < NQ; ++d) {
        simdgroup_float8x8 kb;
        simdgroup_load(kb, kt + (hh * H2 + 8 * d) * LDK + 8 * jb, LDK);
        simdgroup_multiply_accumulate(s, qm[d], kb, s);
      }
      simdgroup_store(s, sp + (hh * BM + rb * 8) * LDS + 8 * jb, LDS);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // (3) Online softmax of row rr: P over the half-0 sums, α on the block's diagonal.
    {
      threadgroup float* s0 = sp + (rb * 8 + rr) * LDS;
      threadgroup const float* s1 = sp + (BM + rb * 8 + rr) * LDS;
      float sv[BC / 8];
      float mx = m;
      for (int i = 0; i < BC / 8; ++i) {
        const int j = kl + 8 * i;
        sv[i] = kt0 + j < lim ? s0[j] + s1[j] : MASKED;  // s = q·k·HD^-1/2·log2 e
        mx = max(mx, sv[i]);
      }
      mx = max(mx, simd_shuffle_xor(mx, ushort(1)));
      mx = max(mx, simd_shuffle_xor(mx, ushort(2)));
      mx = max(mx, simd_shuffle_xor(mx, ushort(4)));
      const float alpha = exp2(m - mx);  // 0 when m was the sentinel and a key is visible now; 1 when nothing changed
      float ps = 0.0f;
      for (int i = 0; i < BC / 8; ++i) {
        const float p = sv[i] == MASKED ? 0.0f : exp2(sv[i] - mx);
        s0[kl + 8 * i] = p;
        ps += p;
      }
      ps += simd_shuffle_xor(ps, ushort(1));
      ps += simd_shuffle_xor(ps, ushort(2));
      ps += simd_shuffle_xor(ps, ushort(4));
      l = l * alpha + ps;
      m = mx;
      if (kl == 0) dg[rb * 64 + rr * 9] = alpha;
      const bool any_moved = simd_any(alpha != 1.0f);
      if (lane == 0) moved[rb * 2 + hh] = any_moved ? 1 : 0;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // (4) O ← diag(α)·O + P·V for this half.
    if (moved[rb * 2] != 0 || moved[rb * 2 + 1] != 0) {
      simdgroup_float8x8 da;
      simdgroup_load(da, dg + rb * 64, 8);
      for (int d = 0; d < NQ; ++d) {
        simdgroup_float8x8 scaled;
        simdgroup_multiply(scaled, da, om[d]);
        om[d] = scaled;
      }
    }
    for (int jb = 0; jb < BC / 8; ++jb) {
      simdgroup_float8x8 pm;
      simdgroup_load(pm, sp + (rb * 8) * LDS + 8 * jb, LDS);
      for (int d = 0; d < NQ; ++d) {
        simdgroup_float8x8 vb;
        simdgroup_load(vb, vt + (8 * jb) * LDV + hh * H2 + 8 * d, LDV);
        simdgroup_multiply_accumulate(om[d], pm, vb, om[d]);  // O += 2^(s−m)·v
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile, the scores and the diagonals are free
  }

  if (SPLIT) {  // the partials: rows r0 + 8·rb .. of this split (rows < Rpad: inside the buffer), and (m, l) per row
    const int prow0 = (split * a.NKV + kvh) * a.Rpad + r0 + rb * 8;
    for (int d = 0; d < NQ; ++d) simdgroup_store(om[d], part + prow0 * HD + hh * H2 + 8 * d, HD);
    if (kl == 0 && r < nrows) {
      device float* ml = part + a.S * a.NKV * a.Rpad * HD + (prow0 + rr) * 2;
      ml[0] = m;
      ml[1] = l;
    }
    return;
  }
  if (kl == 0) lrow[rb * 8 + rr] = l;
  for (int h = 0; h < 2; ++h) {  // the gated output, one head-dim half at a time through `tile`
    if (hh == h)
      for (int d = 0; d < NQ; ++d) simdgroup_store(om[d], tile + rb * 8 * LDO + 8 * d, LDO);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int i = int(tid); i < BM * H2; i += NT) {
      const int rl = i / H2, c = i % H2, ro = r0 + rl;
      if (ro >= nrows) continue;
      const int row = (ro / G) * a.NH + kvh * G + ro % G;  // (t, h) row of qg and out
      const int dcol = h * H2 + c;
      const float g = bf16_to_float(qg[row * 2 * HD + HD + dcol]);
      out[row * HD + dcol] = float_to_bf16(tile[rl * LDO + c] / lrow[rl] * sigmoid_f(g));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// S == 1: the gated output directly.
template <int HD>
[[kernel, max_total_threads_per_threadgroup(256)]] void attn_sg(
    constant AttnMainArgs& args [[buffer(0)]],
    device const int* pos [[buffer(1)]],
    device const float* q [[buffer(2)]],
    device const ushort* k_cache [[buffer(3)]],
    device const ushort* v_cache [[buffer(4)]],
    device const ushort* qg [[buffer(5)]],
    device ushort* out [[buffer(6)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint3 ntg [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[attn_sg_tile(HD)];
  threadgroup float sp[2 * ATTN_SG_BM * (attn_sg_bc(HD) + 4)];
  threadgroup float dg[4 * 64];
  threadgroup int moved[8];
  threadgroup float lrow[ATTN_SG_BM];
  attn_sg_impl<HD, false>(args, pos[0], q, k_cache, v_cache, qg, out, nullptr, tile, sp, dg, moved, lrow, tg, ntg, tid,
                          sg, lane);
}

// S > 1: fp32 partials (O, m, l) of key block z, merged by attn_combine.
template <int HD>
[[kernel, max_total_threads_per_threadgroup(256)]] void attn_sg_split(
    constant AttnMainArgs& args [[buffer(0)]],
    device const int* pos [[buffer(1)]],
    device const float* q [[buffer(2)]],
    device const ushort* k_cache [[buffer(3)]],
    device const ushort* v_cache [[buffer(4)]],
    device float* part [[buffer(5)]],
    uint3 tg [[threadgroup_position_in_grid]],
    uint3 ntg [[threadgroups_per_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint sg [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[attn_sg_tile(HD)];
  threadgroup float sp[2 * ATTN_SG_BM * (attn_sg_bc(HD) + 4)];
  threadgroup float dg[4 * 64];
  threadgroup int moved[8];
  threadgroup float lrow[ATTN_SG_BM];
  attn_sg_impl<HD, true>(args, pos[0], q, k_cache, v_cache, nullptr, nullptr, part, tile, sp, dg, moved, lrow, tg, ntg,
                         tid, sg, lane);
}

// ---- attn_combine: one threadgroup per (t, h); thread = (float4 column c, group g of key blocks) -------------------
// NG = 128 / (HD/4) groups; group g merges blocks g, g+NG, … online, then group 0 merges the groups in order.
[[kernel]] void attn_combine(
    constant AttnMainArgs& args [[buffer(0)]],
    device const int* pos [[buffer(1)]],
    device const float* part [[buffer(2)]],
    device const ushort* qg [[buffer(3)]],
    device ushort* out [[buffer(4)]],
    uint tg [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]]) {
  threadgroup float red_m[ATTN_COMBINE_NT / 8];  // NG ≤ 16 groups (HD = 32)
  threadgroup float red_l[ATTN_COMBINE_NT / 8];
  threadgroup float4 red_o[ATTN_COMBINE_NT];
  const int HD = args.HD, C4 = HD / 4, NG = ATTN_COMBINE_NT / C4;
  const int c = int(tid) % C4, g = int(tid) / C4;
  const int t = int(tg) / args.NH, h = int(tg) % args.NH, kvh = h / args.G, r = t * args.G + h % args.G;
  const int n_row = min(pos[0] + t + 1, args.cache_cap);
  const int nb = min(args.S, (n_row + args.block - 1) / args.block);  // blocks holding ≥ 1 key this row sees
  device const float* ml = part + args.S * args.NKV * args.Rpad * HD;
  float M = MASKED, L = 0.0f;
  float4 acc = float4(0.0f);
  for (int b = g; b < nb; b += NG) {
    const int prow = (b * args.NKV + kvh) * args.Rpad + r;
    const float mb = ml[prow * 2], lb = ml[prow * 2 + 1];
    const float4 ob = ((device const float4*)(part + prow * HD))[c];
    const float mn = max(M, mb), fo = exp2(M - mn), fb = exp2(mb - mn);
    L = L * fo + lb * fb;
    acc = acc * fo + ob * fb;
    M = mn;
  }
  if (c == 0) {
    red_m[g] = M;
    red_l[g] = L;
  }
  red_o[tid] = acc;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (g != 0) return;
  float Mx = MASKED;
  for (int i = 0; i < NG; ++i) Mx = max(Mx, red_m[i]);  // a real score: group 0 holds block 0
  float Lx = 0.0f;
  float4 o = float4(0.0f);
  for (int i = 0; i < NG; ++i) {
    const float f = exp2(red_m[i] - Mx);  // 0 for a group without blocks
    Lx += f * red_l[i];
    o += f * red_o[i * C4 + c];
  }
  const int row = t * args.NH + h;
  device const ushort* gate = qg + row * 2 * HD + HD + 4 * c;
  device ushort* dst = out + row * HD + 4 * c;
  const float ov[4] = {o.x, o.y, o.z, o.w};
  for (int e = 0; e < 4; ++e) dst[e] = float_to_bf16(ov[e] / Lx * sigmoid_f(bf16_to_float(gate[e])));
}

template [[host_name("attn_main_hd32")]] [[kernel]] decltype(attn_main<32, false>) attn_main<32, false>;
template [[host_name("attn_main_hd64")]] [[kernel]] decltype(attn_main<64, false>) attn_main<64, false>;
template [[host_name("attn_main_hd64_r8")]] [[kernel]] decltype(attn_main<64, true>) attn_main<64, true>;
template [[host_name("attn_main_hd128")]] [[kernel]] decltype(attn_main<128, false>) attn_main<128, false>;
template [[host_name("attn_main_hd128_r8")]] [[kernel]] decltype(attn_main<128, true>) attn_main<128, true>;
template [[host_name("attn_main_hd256")]] [[kernel]] decltype(attn_main<256, false>) attn_main<256, false>;
template [[host_name("attn_main_hd256_r8")]] [[kernel]] decltype(attn_main<256, true>) attn_main<256, true>;
template [[host_name("attn_split_hd32")]] [[kernel]] decltype(attn_split<32, false>) attn_split<32, false>;
template [[host_name("attn_split_hd64")]] [[kernel]] decltype(attn_split<64, false>) attn_split<64, false>;
template [[host_name("attn_split_hd64_r8")]] [[kernel]] decltype(attn_split<64, true>) attn_split<64, true>;
template [[host_name("attn_split_hd128")]] [[kernel]] decltype(attn_split<128, false>) attn_split<128, false>;
template [[host_name("attn_split_hd128_r8")]] [[kernel]] decltype(attn_split<128, true>) attn_split<128, true>;
template [[host_name("attn_split_hd256")]] [[kernel]] decltype(attn_split<256, false>) attn_split<256, false>;
template [[host_name("attn_split_hd256_r8")]] [[kernel]] decltype(attn_split<256, true>) attn_split<256, true>;
template [[host_name("attn_sg_hd32")]] [[kernel]] decltype(attn_sg<32>) attn_sg<32>;
template [[host_name("attn_sg_hd64")]] [[kernel]] decltype(attn_sg<64>) attn_sg<64>;
template [[host_name("attn_sg_hd128")]] [[kernel]] decltype(attn_sg<128>) attn_sg<128>;
template [[host_name("attn_sg_hd256")]] [[kernel]] decltype(attn_sg<256>) attn_sg<256>;
template [[host_name("attn_sg_split_hd32")]] [[kernel]] decltype(attn_sg_split<32>) attn_sg_split<32>;
template [[host_name("attn_sg_split_hd64")]] [[kernel]] decltype(attn_sg_split<64>) attn_sg_split<64>;
template [[host_name("attn_sg_split_hd128")]] [[kernel]] decltype(attn_sg_split<128>) attn_sg_split<128>;
template [[host_name("attn_sg_split_hd256")]] [[kernel]] decltype(attn_sg_split<256>) attn_sg_split<256>;
