// attention.cu: the gated full-attention mixer (architecture.md §4, §3.4): q/k RMSNorm, partial RoPE, K/V cache
// append, causal GQA softmax attention on the tensor cores, and the sigmoid output gate.
//
// Math     per token t (position p = pos0 + t) and head h (kv head h / G, G = NH/NKV):
//            q, g = qg[t, h, :HD], qg[t, h, HD:];  q ← RMSNorm(q; q_norm), k ← RMSNorm(k; k_norm)   (eps a.eps)
//            RoPE on dims i < R with pairs (i, i+R/2): θ_i = theta^(−2i/R) (powf), angle = float(p)·θ_i
//            K[p], V[p] ← k, v (bf16);  o = softmax(q·K[0..p]ᵀ / sqrt(HD)) · V[0..p];  out = o ⊙ σ(g)
//          Online softmax in the log2 domain: s = q·k·(HD^-1/2·log2 e), m = running max, l = Σ 2^(s−m),
//          O = Σ 2^(s−m)·v; splits of the key range combine as O = Σ_s 2^(m_s−M)·O_s / Σ_s 2^(m_s−M)·l_s.
// Layout   qg bf16[T, NH, 2·HD]; k, v bf16[T, NKV·HD]; caches bf16[cap, NKV, HD]; q_norm, k_norm fp32[HD];
//          out bf16[T, NH·HD]. Scratch: kSlotAttnQ bf16[T, NH, HD] (normalised, rotated q);
//          kSlotAttnPartial fp32 O[S, NKV, Rpad, HD] then (m, l)[S, NKV, Rpad, 2] (split-K partials).
//          Attention rows are GQA-packed per kv head: row r = t·G + (h mod G), so one K/V tile serves all G heads.
// Traffic  real shapes (NH=16, NKV=2, HD=256), per layer: K/V cache read 2 KB per context token, once per kv head
//          (decode at L=4K: 8.4 MB, 128K: 268 MB); q/gate/out 48 KB per token.
// Work     4·NH·HD = 16 KFLOP per (query, visible key). Decode at L keys: 16K·L FLOP vs 2 KB·L bytes → 8 FLOP/B,
//          bandwidth-bound: floor 8.4 MB @ 4.8 TB/s = 1.7 µs (4K), 56 µs (128K) per layer.
//          Prefill of a 4K prompt from 0: 16K·4096·4097/2 = 137 GFLOP per layer (1.37 TFLOP for the 10 layers),
//          compute-bound: floor ≈ 0.2 ms per layer at ~700 TFLOP/s (mma.sync realistically reaches half of that).
// Mapping  attn_prep: one warp per (token, q head or kv head); fp32 in shared memory for the rotate-half pairs;
//          writes q to scratch and k (normalised, rotated), v to the caches. θ_i come from the host.
//          attn_mma<HD, RW, KW, NSTAGE>: block = RW·KW warps over one kv head, BM = 16·RW packed rows, key tiles
//          of kBC = 64 keys, NSTAGE of them in flight through cp.async (16-byte, zero-filled beyond the live
//          range); Q tile resident in shared memory. Warp (wr, wk) owns rows 16·wr..+15 and keys
//          kBC/KW·wk..+kBC/KW−1 of each tile; S = Q·Kᵀ and O += P·V with mma.sync m16n8k16 bf16→fp32 (ldmatrix
//          for Q and K, ldmatrix.trans for V), P stays in registers; O is HD/8·4 fp32 registers per thread
//          (128 at HD=256).
//          Shared rows are padded by 16 bytes (stride HD+8), so ldmatrix and cp.async are bank-conflict free.
//            prefill (T·G > 16): RW=8, KW=1, NSTAGE=2 (8 warps, 128 rows, 198 KB smem, 255 regs, no spills);
//            decode (T·G ≤ 16): RW=1, KW=4, NSTAGE=3 (4 warps split every tile's keys and merge through shared
//            memory at the end; 206 KB smem, 188 regs; switch attn_kv_early: the first two tiles' rows before pos0
//            copied before the PDL wait, under attn_prep). Both: one block per SM.
//          attn_wgmma<HD> (prefill on sm_90a, switch attn_wgmma, HD % 64 == 0; the same grid, rows and partials):
//            2 warpgroups × 64 rows; S by wgmma m64n64k16 (Q, K from shared memory), P·V by wgmma with P in registers
//            and V N-major; tile it+1's S overlaps tile it's P·V (see the kernel; 254 regs, 193 KB smem).
//          Causal: a warp skips sub-tiles past its last row's limit, masks only sub-tiles that cross its first
//          row's limit; a block stops at its last row's limit. Heavy (late) row tiles launch first.
//          Split-K: grid.z = S splits of the key range, each a multiple of kBC keys long, sized in the kernel from
//          the (device) position: chunk = ⌈⌈(pos0+T)/S⌉/kBC⌉·kBC, blocks past the live range exit at once. With
//          S > 1 the blocks write fp32 partials and attn_combine merges them (one block per (t, h); thread =
//          float4 column × group of splits, online within a thread, then across groups). Splits are used only
//          below one wave of blocks. S depends only on host values that stay fixed under graph capture
//          (cache_cap when pos_dev is set), never on the device position.
// Checks   NH % NKV == 0; HD ∈ {32, 64, 128, 256}; rotary_dim even, ≤ HD; 0 ≤ pos0, pos0 + T ≤ cache_cap (device
//          reads and writes are also clamped to cache_cap); cache rows 16-byte aligned (cudaMalloc'd buffers).
//          RoPE angles reach 10^5 rad: they are reduced mod 2π in double before sincosf (fast-math safe).
// Ref      cpu/attention.cpp · Test tests/ops/test_ops.py (op "attention"), tests/test_cuda.py · Bench
//          benchmarks/bench_ops.py -o attention
// History  v1, H200, real shapes, per layer: prefill 4K from 0 633 µs (217 TFLOP/s incl. prep), 2K chunk
//          at 8K 1.23 ms (252 TFLOP/s); decode T=1 (CUDA graph) 13.5 µs at 4K (latency-bound: prep ~2.8 µs, main
//          + combine ~10 µs), 78 µs at 128K (3.4 TB/s of K/V).
//          v2 (2026-12-02) attn_wgmma for prefill: the 4096-token chunk after 28,672 tokens 5.38 ms per layer
//          (383 TFLOP/s; mma.sync ~250); 32K / 128K prefill end to end +10 % / +24 % (benchmarks/NOTES.md v7).
//          v3 (2026-12-03) attn_prep loads its q/k norm weights before the PDL wait (benchmarks/NOTES.md v11).
//          v4 (2026-12-07) attn_kv_early: decode's cached K/V rows copied before the PDL wait; H100 decode +1.16 % at
//          4K (the whole split, 64 keys, in flight before the wait), +1.58 % at 32K (benchmarks/NOTES.md session 59).
#include "backend/checks.h"
#include "backend/cuda/ops.cuh"
#include "backend/cuda/wgmma.cuh"

#include <algorithm>
#include <cmath>

namespace lily::cuda {

namespace {

constexpr int kBC = 64;              // keys per shared-memory tile
constexpr int kDecodeMaxRows = 16;   // T·G ≤ this → the decode instance (one 16-row MMA tile per kv head)
constexpr int kMaxSplits = 1024;     // split-K partitions at most (bounds the partial scratch)
constexpr int kMinSplitKeys = 256;   // a split is worth its partials only past a few tiles
constexpr int kMinDecodeSplitKeys = 64;  // decode, switch attn_short_splits: one tile a split (+1.8 % at 4K)
constexpr int kPrepWarps = 4;
constexpr int kMaxHD = 256;
constexpr int kCombineGroups = 16;  // attn_combine: HD/4 float4 columns × up to 16 groups of splits per block

struct KArgs {
  int T, NH, NKV, G, HD;
  int pos0, cache_cap;
  const int32_t* pos_dev;  // when set, the position comes from here (graph-captured decode)
  int S;                   // split-K partitions (grid.z)
  int Rpad;                // packed rows per kv head, padded to the block tile (partial layout)
  float sl2;               // HD^-1/2 · log2(e)
  float eps;
  int R;                   // rotary dims
};

// RoPE frequencies θ_i = theta^(−2i/R), computed on the host with the reference's own powf expression.
struct RopeFreq {
  float inv_freq[kMaxHD / 2];
};

__device__ __forceinline__ int cur_pos0(const KArgs& a) { return a.pos_dev ? *a.pos_dev : a.pos0; }

// Keys per split: every block and attn_combine derive it the same way from the device position.
__device__ __forceinline__ int split_chunk(int n_keys, int S) {
  const int per = (n_keys + S - 1) / S;
  return (per + kBC - 1) / kBC * kBC;
}

// ---- PTX wrappers ----------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int n = valid ? 16 : 0;  // src-size 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(n) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const bf16* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const bf16* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// ---- prep: norm + RoPE + cache append ---------------------------------------------------------------------
// Warp w of the grid handles item j = w mod (NH+NKV) of token t = w / (NH+NKV): j < NH is q head j, else kv
// head j−NH (k normalised and rotated into the K cache, v copied into the V cache).
__global__ void __launch_bounds__(32 * kPrepWarps) attn_prep_kernel(const KArgs a, const __grid_constant__ RopeFreq rf,
                                                                  const bf16* __restrict__ qg,
                                                                  const bf16* __restrict__ k,
                                                                  const bf16* __restrict__ v,
                                                                  const float* __restrict__ q_norm,
                                                                  const float* __restrict__ k_norm,
                                                                  bf16* __restrict__ k_cache,
                                                                  bf16* __restrict__ v_cache, bf16* __restrict__ q) {
  pdl_trigger();
  constexpr int VPL = kMaxHD / 32;  // values per lane at most; unrolled so that all loads are in flight at once
  __shared__ float buf[kPrepWarps][kMaxHD];
  const int lane = threadIdx.x & 31, wib = threadIdx.x >> 5;
  const int item = blockIdx.x * kPrepWarps + wib, per_t = a.NH + a.NKV;
  if (item >= a.T * per_t) return;  // whole warp; only __syncwarp below
  const int t = item / per_t, j = item % per_t, HD = a.HD;
  float wv[VPL];  // the norm's weights before the PDL wait
#pragma unroll
  for (int u = 0; u < VPL; ++u) wv[u] = lane + 32 * u < HD ? (j < a.NH ? q_norm : k_norm)[lane + 32 * u] : 0.0f;
  pdl_wait();
  const int pos = cur_pos0(a) + t;
  const bf16* src;
  bf16* dst;
  if (j < a.NH) {
    src = qg + (size_t(t) * a.NH + j) * 2 * HD;
    dst = q + (size_t(t) * a.NH + j) * HD;
  } else {
    if (pos >= a.cache_cap) return;  // host checks pos0 + T ≤ cap; a stale device position never writes past it
    const int h = j - a.NH;
    const size_t in = (size_t(t) * a.NKV + h) * HD, row = (size_t(pos) * a.NKV + h) * HD;
    src = k + in;
    dst = k_cache + row;
#pragma unroll
    for (int u = 0; u < VPL; ++u)
      if (lane + 32 * u < HD) v_cache[row + lane + 32 * u] = v[in + lane + 32 * u];
  }
  float xv[VPL], ss = 0.0f;
#pragma unroll
  for (int u = 0; u < VPL; ++u) {
    const int i = lane + 32 * u;
    xv[u] = i < HD ? to_f(src[i]) : 0.0f;
    ss += xv[u] * xv[u];
  }
  ss = warp_sum(ss);
  const float r = 1.0f / sqrtf(ss / float(HD) + a.eps);  // RMSNorm
  float* x = buf[wib];
#pragma unroll
  for (int u = 0; u < VPL; ++u)
    if (lane + 32 * u < HD) x[lane + 32 * u] = xv[u] * r * wv[u];
  __syncwarp();
  const int half = a.R / 2;
#pragma unroll
  for (int u = 0; u < VPL; ++u) {
    const int i = lane + 32 * u;
    if (i >= HD) break;
    float y = x[i];
    if (i < a.R) {  // rotate-half RoPE: pair (ii, ii + half)
      const int ii = i < half ? i : i - half;
      const float angle = float(pos) * rf.inv_freq[ii];  // fp32, as the reference
      // Reduce mod 2π in double (angle < 2^24 loses nothing), so sincosf stays on its short, accurate path.
      const double ad = double(angle);
      const float red = float(fma(-rint(ad * 0.15915494309189535), 6.283185307179586, ad));
      float sn, cs;
      sincosf(red, &sn, &cs);
      const float x0 = x[ii], x1 = x[ii + half];
      y = i < half ? x0 * cs - x1 * sn : x1 * cs + x0 * sn;
    }
    dst[i] = __float2bfloat16_rn(y);
  }
}

// The online softmax of one key tile for a thread's rows g and g + 8, s[4j + e] (j < NJ) being row g + 8·(e/2) and key
// kb + 8j + 2·tig + e mod 2 (the m16n8 C layout), in two halves. softmax_max: s scaled into the log2 domain and
// masked (keys ≥ lim[row], when mask); the running max m and sum l updated; base[i] the exponent base of row i, and
// scale(i, alpha) called with the factor for its earlier O. A row with nothing visible yet keeps p = 0, never NaN.
// softmax_exp: s replaced by p = 2^(s − base), added to l (the thread's partial sum; the quad reduces it at the end).
template <int NJ, typename Scale>
__device__ __forceinline__ void softmax_max(float* s, int kb, const int* lim, bool mask, float sl2, float* m,
                                            float* l, float* base, Scale&& scale) {
  const int tig = threadIdx.x & 3;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[4 * j + e] * sl2;
      if (mask && kb + j * 8 + 2 * tig + (e & 1) >= lim[e >> 1]) x = -INFINITY;
      s[4 * j + e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    const float mn = fmaxf(m[i], mx[i]);
    base[i] = mn == -INFINITY ? 0.0f : mn;
    const float alpha = exp2f(m[i] - base[i]);
    m[i] = mn;
    l[i] *= alpha;
    scale(i, alpha);
  }
}
template <int NJ>
__device__ __forceinline__ void softmax_exp(float* s, const float* base, float* l) {
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float p = exp2f(s[4 * j + e] - base[e >> 1]);
      s[4 * j + e] = p;
      l[e >> 1] += p;
    }
}

// ---- attention: one warp's 16 rows against its NK keys of the current tile --------------------------------
// qs: the warp's 16 Q rows, ks/vs: its NK K/V rows (shared, stride LD). kb: absolute index of key row 0.
// lim[i]: keys < lim[i] are visible to the thread's row g + 8i (g = lane / 4). mask: some key may be ≥ a limit.
template <int HD, int NK>
__device__ __forceinline__ void warp_tile(const bf16* qs, const bf16* ks, const bf16* vs, int kb, const int* lim,
                                          bool mask, float sl2, float (&o)[HD / 8][4], float* m, float* l) {
  constexpr int LD = HD + 8;
  const int lane = threadIdx.x & 31;
  float s[NK / 8][4];
#pragma unroll
  for (int j = 0; j < NK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
  // S = Q·Kᵀ: A = Q rows (ldmatrix), B[k=d][n=key] = K[key][d] (ldmatrix, two key groups of 8 per x4).
  const bf16* qa = qs + (lane & 15) * LD + (lane >> 4) * 8;
  const bf16* kbp = ks + ((lane & 7) + (lane >> 4) * 8) * LD + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    uint32_t qa4[4];
    ldmatrix_x4(qa4, qa + kk * 16);
#pragma unroll
    for (int n = 0; n < NK / 16; ++n) {
      uint32_t b[4];
      ldmatrix_x4(b, kbp + n * 16 * LD + kk * 16);
      mma_bf16(s[2 * n], qa4, b[0], b[1]);
      mma_bf16(s[2 * n + 1], qa4, b[2], b[3]);
    }
  }
  // The online softmax, the earlier O rescaled as each row's new maximum is known.
  float base[2];
  softmax_max<NK / 8>(&s[0][0], kb, lim, mask, sl2, m, l, base, [&](int i, float alpha) {
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      o[n][2 * i] *= alpha;
      o[n][2 * i + 1] *= alpha;
    }
  });
  softmax_exp<NK / 8>(&s[0][0], base, l);
  // O += P·V: A = P from the S accumulators, B[k=key][n=d] = V[key][d] (ldmatrix.trans).
  const bf16* vbp = vs + (lane & 15) * LD + (lane >> 4) * 8;
#pragma unroll
  for (int kk = 0; kk < NK / 16; ++kk) {
    uint32_t pa[4];
    pa[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
    pa[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    pa[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    pa[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
    for (int n = 0; n < HD / 16; ++n) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, vbp + kk * 16 * LD + n * 16);
      mma_bf16(o[2 * n], pa, b[0], b[1]);
      mma_bf16(o[2 * n + 1], pa, b[2], b[3]);
    }
  }
}

// Where packed row r of kv head kvh goes: the gated output row (S == 1) or this split's partial row (S > 1).
struct RowDst {
  const bf16* gate;  // S == 1: gate and out rows
  bf16* out;
  float* po;  // S > 1: partial O row and its (m, l)
  float* pml;
};
__device__ __forceinline__ RowDst row_dst(const KArgs& a, int kvh, int r, const bf16* qg, bf16* out, float* po,
                                          float* pml) {
  RowDst d{};
  if (a.S == 1) {
    const size_t row = size_t(r / a.G) * a.NH + kvh * a.G + r % a.G;
    d.gate = qg + (row * 2 + 1) * a.HD;
    d.out = out + row * a.HD;
  } else {
    const size_t row = (size_t(blockIdx.z) * a.NKV + kvh) * a.Rpad + r;
    d.po = po + row * a.HD;
    d.pml = pml + row * 2;
  }
  return d;
}

// The epilogue of a warp that owns packed rows wrow .. wrow + 15 whole (its thread rows g and g + 8): the gated
// output (S == 1) or this split's partials. o[4n + 2i + e]: row g + 8i, dims 8n + 2·tig + e (the m16n8 C layout of
// mma.sync and of wgmma's accumulators alike); l is the thread's partial sum, reduced over the quad here.
template <int HD>
__device__ __forceinline__ void store_rows(const KArgs& a, int kvh, int wrow, const float* o, const float* m,
                                           float* l, const bf16* qg, bf16* out, float* po, float* pml) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3, nrows = a.T * a.G;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = wrow + g + 8 * i;
    if (r >= nrows) continue;
    const RowDst dst = row_dst(a, kvh, r, qg, out, po, pml);
    if (a.S == 1) {
      const float inv = 1.0f / l[i];
      __nv_bfloat162 gv[HD / 8];
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) gv[n] = *reinterpret_cast<const __nv_bfloat162*>(dst.gate + n * 8 + 2 * tig);
#pragma unroll
      for (int n = 0; n < HD / 8; ++n)
        *reinterpret_cast<__nv_bfloat162*>(dst.out + n * 8 + 2 * tig) =
            __floats2bfloat162_rn(o[4 * n + 2 * i] * inv * sigmoidf_(__low2float(gv[n])),
                                  o[4 * n + 2 * i + 1] * inv * sigmoidf_(__high2float(gv[n])));
    } else {
#pragma unroll
      for (int n = 0; n < HD / 8; ++n)
        *reinterpret_cast<float2*>(dst.po + n * 8 + 2 * tig) = make_float2(o[4 * n + 2 * i], o[4 * n + 2 * i + 1]);
      if (tig == 0) *reinterpret_cast<float2*>(dst.pml) = make_float2(m[i], l[i]);
    }
  }
}

// The key range of block (blockIdx.x, ·, blockIdx.z) of BM packed rows, in tiles of BC keys. Late rows see the most
// keys, so they launch first; the block stops at its last row's limit and its split's end. ntiles = 0: the split
// lies past the live range (the whole block returns).
struct BlockKeys {
  int pos0, nrows, r0, k0, kend, ntiles;
};
__device__ __forceinline__ BlockKeys block_keys(const KArgs& a, int BM, int BC) {
  BlockKeys b;
  b.pos0 = cur_pos0(a);
  b.nrows = a.T * a.G;
  const int chunk = split_chunk(b.pos0 + a.T, a.S);
  b.r0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const int t_hi = min(a.T - 1, (b.r0 + BM - 1) / a.G);
  b.k0 = blockIdx.z * chunk;
  b.kend = min(min(b.k0 + chunk, b.pos0 + t_hi + 1), a.cache_cap);
  b.ntiles = b.k0 < b.kend ? (b.kend - b.k0 + BC - 1) / BC : 0;
  return b;
}
// Element offset of dims c·8 .. c·8 + 7 of packed row r (kv head kvh) in the normalised q [T, NH, HD].
__device__ __forceinline__ size_t q_at(const KArgs& a, int kvh, int r, int c) {
  return (size_t(r / a.G) * a.NH + kvh * a.G + r % a.G) * a.HD + c * 8;
}

// grid (row tiles, NKV, S); block RW·KW warps; NSTAGE K/V tiles in flight. See the header for the mapping.
// EARLY (decode, switch attn_kv_early): the first NSTAGE−1 tiles' keys before pos0 are copied before the PDL wait.
// Those cache rows and the position were written by earlier forwards (a replayed step's position by the previous
// step's sampler), as the GDN state a scan loads before its wait; this forward's rows [pos0, pos0 + T), which
// attn_prep writes just before, are copied after the wait with the Q tile.
template <int HD, int RW, int KW, int NSTAGE, bool EARLY>
__global__ void __launch_bounds__(32 * RW * KW, 1)
    attn_mma_kernel(const KArgs a, const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                    const bf16* __restrict__ v_cache, const bf16* __restrict__ qg, bf16* __restrict__ out,
                    float* __restrict__ po, float* __restrict__ pml) {
  pdl_trigger();
  if constexpr (!EARLY) pdl_wait();
  constexpr int BM = 16 * RW, NK = kBC / KW, LD = HD + 8, NT = 32 * RW * KW, CH = HD / 8;
  static_assert(NK % 16 == 0, "each warp needs whole 16-key MMA steps");
  static_assert(KW == 1 || (RW == 1 && NT == 128), "the KW > 1 merge maps 8 threads to each of 16 rows");
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* qs = reinterpret_cast<bf16*>(smem);  // [BM][LD]
  bf16* ks = qs + BM * LD;                   // [NSTAGE][kBC][LD]
  bf16* vs = ks + NSTAGE * kBC * LD;         // [NSTAGE][kBC][LD]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wr = warp / KW, wk = warp % KW;
  const int g = lane >> 2, tig = lane & 3;
  const BlockKeys bk = block_keys(a, BM, kBC);
  if (bk.ntiles == 0) return;  // whole block
  const int pos0 = bk.pos0, nrows = bk.nrows, r0 = bk.r0, k0 = bk.k0, kend = bk.kend, ntiles = bk.ntiles;
  const int kvh = blockIdx.y;

  auto load_q = [&] {  // the Q tile, zero rows past nrows
    for (int i = tid; i < BM * CH; i += NT) {
      const int row = i / CH, c = i % CH, r = r0 + row;
      const bool ok = r < nrows;
      const size_t src = ok ? q_at(a, kvh, r, c) : 0;
      cp_async16(qs + row * LD + c * 8, q + src, ok);
    }
  };
  auto copy_key = [&](int stage, int row, int c, int key, bool ok) {  // ok = false: the 16 bytes zero-filled
    const size_t src = ok ? (size_t(key) * a.NKV + kvh) * HD + c * 8 : 0;
    cp_async16(ks + (stage * kBC + row) * LD + c * 8, k_cache + src, ok);
    cp_async16(vs + (stage * kBC + row) * LD + c * 8, v_cache + src, ok);
  };
  // Tile it into stage it mod NSTAGE; keys ≥ kend are zero-filled. early: keys in [pos0, kend) are left out (this
  // forward's rows, copied after the wait).
  auto load_kv = [&](int it, bool early) {
    if (it < ntiles) {
      const int kt = k0 + it * kBC, stage = it % NSTAGE;
      for (int i = tid; i < kBC * CH; i += NT) {
        const int row = i / CH, c = i % CH, key = kt + row;
        if (early && key >= pos0 && key < kend) continue;
        copy_key(stage, row, c, key, key < kend);
      }
    }
    cp_async_commit();
  };
  // Tile i lives in group i (empty groups keep the count uniform), so waiting for all but the newest NSTAGE−1
  // groups lands tile it. Plain: the Q tile joins tile 0's group. EARLY: tiles 0 .. NSTAGE−2 go before the wait,
  // then the Q tile and this forward's rows of those tiles form one more group, landed with them before the loop.
  if constexpr (EARLY) {
#pragma unroll
    for (int st = 0; st < NSTAGE - 1; ++st) load_kv(st, true);
    pdl_wait();
    load_q();
    const int lo = max(pos0, k0), hi = min(kend, k0 + (NSTAGE - 1) * kBC);
    for (int i = tid; i < max(hi - lo, 0) * CH; i += NT) {
      const int key = lo + i / CH, it = (key - k0) / kBC;
      copy_key(it % NSTAGE, key - k0 - it * kBC, i % CH, key, true);
    }
    cp_async_commit();
    cp_async_wait<0>();
  } else {
    load_q();
#pragma unroll
    for (int st = 0; st < NSTAGE - 1; ++st) load_kv(st, false);
  }

  // Visible-key limits: the thread's rows g, g+8; the warp's first and last rows (limits grow with the row).
  auto limit = [&](int r) { return min(pos0 + min(r / a.G, a.T - 1) + 1, kend); };
  const int wrow = r0 + wr * 16;
  const int lim[2] = {limit(wrow + g), limit(wrow + g + 8)};
  const int lim_lo = limit(wrow), lim_hi = limit(wrow + 15);
  const bool active = wrow < nrows;

  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int it = 0; it < ntiles; ++it) {
    load_kv(it + NSTAGE - 1, false);
    cp_async_wait<NSTAGE - 1>();
    __syncthreads();
    const int kb = k0 + it * kBC + wk * NK;
    if (active && kb < lim_hi) {
      const int off = ((it % NSTAGE) * kBC + wk * NK) * LD;
      warp_tile<HD, NK>(qs + wr * 16 * LD, ks + off, vs + off, kb, lim, kb + NK > lim_lo, a.sl2, o, m, l);
    }
    __syncthreads();  // a later iteration's load overwrites this stage
  }

  if constexpr (KW == 1) {
    if (active) store_rows<HD>(a, kvh, wrow, &o[0][0], m, l, qg, out, po, pml);
  } else {
    // Merge the KW warps' (m, l, O) of the same 16 rows through shared memory (the K/V stages are free now:
    // every real tile's group has landed and the loop ended on a barrier).
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
      l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    __shared__ float red_m[KW][16], red_l[KW][16];
    float* ob = reinterpret_cast<float*>(ks);  // [KW][16][HD]
    if (tig == 0) {
      red_m[wk][g] = m[0], red_m[wk][g + 8] = m[1];
      red_l[wk][g] = l[0], red_l[wk][g + 8] = l[1];
    }
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      const int d = n * 8 + 2 * tig;
      *reinterpret_cast<float2*>(ob + (wk * 16 + g) * HD + d) = make_float2(o[n][0], o[n][1]);
      *reinterpret_cast<float2*>(ob + (wk * 16 + g + 8) * HD + d) = make_float2(o[n][2], o[n][3]);
    }
    __syncthreads();
    // Thread → row tid/8, dims 4·(tid mod 8) + 32·c: 8 threads read one row's 128 contiguous bytes.
    const int row = tid >> 3, part = tid & 7, r = r0 + row;
    if (r >= nrows) return;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < KW; ++w) M = fmaxf(M, red_m[w][row]);
    const float Mb = M == -INFINITY ? 0.0f : M;
    float f[KW], L = 0.0f;
#pragma unroll
    for (int w = 0; w < KW; ++w) {
      f[w] = exp2f(red_m[w][row] - Mb);
      L += f[w] * red_l[w][row];
    }
    const RowDst dst = row_dst(a, kvh, r, qg, out, po, pml);
    uint2 gv[HD / 32];
    if (a.S == 1) {
#pragma unroll
      for (int c = 0; c < HD / 32; ++c) gv[c] = *reinterpret_cast<const uint2*>(dst.gate + 4 * part + 32 * c);
    }
#pragma unroll
    for (int c = 0; c < HD / 32; ++c) {
      const int d = 4 * part + 32 * c;
      float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        const float4 ow = *reinterpret_cast<const float4*>(ob + (w * 16 + row) * HD + d);
        v.x += f[w] * ow.x, v.y += f[w] * ow.y, v.z += f[w] * ow.z, v.w += f[w] * ow.w;
      }
      if (a.S == 1) {
        const float inv = 1.0f / L;
        const float2 g01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gv[c].x));
        const float2 g23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gv[c].y));
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x * inv * sigmoidf_(g01.x), v.y * inv * sigmoidf_(g01.y));
        const __nv_bfloat162 hi = __floats2bfloat162_rn(v.z * inv * sigmoidf_(g23.x), v.w * inv * sigmoidf_(g23.y));
        uint2 u;
        u.x = *reinterpret_cast<const uint32_t*>(&lo);
        u.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(dst.out + d) = u;
      } else {
        *reinterpret_cast<float4*>(dst.po + d) = v;
      }
    }
    if (a.S > 1 && part == 0) *reinterpret_cast<float2*>(dst.pml) = make_float2(M, L);
  }
}

// ---- prefill on wgmma (sm_90a; switch attn_wgmma) ------------------------------------------------------------
// grid (row tiles, NKV, S) as attn_mma's prefill instance; block = 2 warpgroups, warpgroup w owns packed rows
// r0 + 64w .. +63 (warp w·4 + j rows 16j .. 16j + 15 of them). Per key tile of kWgKeys: S = Q·Kᵀ by 16 wgmma
// m64n64k16 with Q and K from shared memory; the online softmax in registers; O += P·V by wgmma with P from
// registers (the S accumulators repacked as bf16 A fragments) and V read N-major. Tile it's P·V runs while tile
// it+1's S is computed and softmaxed (issued first, retired by wait_group 1), so the tensor pipe has the next tile's
// work while a warpgroup is in its softmax. One barrier per tile: K of tile it+2 and V of it+1 are copied
// (cp.async, one group) into the stages that tiles it and it−1 freed.
constexpr int kWgRows = 128;  // packed rows per block
constexpr int kWgKeys = 64;   // keys per tile

template <int HD>
struct WgLayout {
  static constexpr int kQ = kWgRows * HD * 2;     // the Q tile: HD/64 blocks of 128 rows × 128 bytes
  static constexpr int kTile = kWgKeys * HD * 2;  // one K or V tile: HD/64 blocks of 64 keys × 128 bytes
  static constexpr int kBlk = kWgKeys * 128;      // the stride between a K/V tile's 64-dim blocks (V's LBO)
  static constexpr int kBytes = 1024 + kQ + 4 * kTile;  // alignment slack, Q, K stages 0–1, V stages 0–1
};

// Byte offset of 16-byte chunk c (of HD/8) of row r in a tile of R rows (wgmma.cuh's K-major layout).
__device__ __forceinline__ uint32_t wg_off(int R, int r, int c) { return uint32_t((c >> 3) * R * 128) + swz(r, c & 7); }

template <int HD>
__global__ void __launch_bounds__(256, 1)
    attn_wgmma_kernel(const KArgs a, const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                      const bf16* __restrict__ v_cache, const bf16* __restrict__ qg, bf16* __restrict__ out,
                      float* __restrict__ po, float* __restrict__ pml) {
  pdl_trigger();
  pdl_wait();
#ifdef LILY_SM90A_DEVICE
  using L = WgLayout<HD>;
  constexpr int CH = HD / 8, PN = HD >= 128 ? 128 : HD, NPV = HD / PN;
  extern __shared__ char smem_raw[];
  uint32_t sbase;
  char* smem = aligned_1k(smem_raw, sbase);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2;
  const BlockKeys bk = block_keys(a, kWgRows, kWgKeys);
  if (bk.ntiles == 0) return;  // whole block
  const int pos0 = bk.pos0, nrows = bk.nrows, r0 = bk.r0, k0 = bk.k0, kend = bk.kend, ntiles = bk.ntiles;
  const int kvh = blockIdx.y;

  for (int i = tid; i < kWgRows * CH; i += 256) {  // Q, zero rows past nrows
    const int row = i / CH, c = i % CH, r = r0 + row;
    const bool ok = r < nrows;
    const size_t src = ok ? q_at(a, kvh, r, c) : 0;
    cp_async16(smem + wg_off(kWgRows, row, c), q + src, ok);
  }
  auto load = [&](const bf16* cache, int off, int it) {  // tile it of K or V at byte offset off; keys ≥ kend zero
    if (it >= ntiles) return;
    const int kt = k0 + it * kWgKeys;
    for (int i = tid; i < kWgKeys * CH; i += 256) {
      const int row = i / CH, c = i % CH, key = kt + row;
      const bool ok = key < kend;
      const size_t src = ok ? (size_t(key) * a.NKV + kvh) * HD + c * 8 : 0;
      cp_async16(smem + off + wg_off(kWgKeys, row, c), cache + src, ok);
    }
  };
  auto koff = [](int it) { return L::kQ + (it & 1) * L::kTile; };  // K stage of tile it, then the V stage
  auto voff = [](int it) { return L::kQ + (2 + (it & 1)) * L::kTile; };
  load(k_cache, koff(0), 0);
  cp_async_commit();
  load(k_cache, koff(1), 1);
  load(v_cache, voff(0), 0);
  cp_async_commit();

  auto limit = [&](int r) { return min(pos0 + min(r / a.G, a.T - 1) + 1, kend); };
  const int wrow = r0 + 64 * wg + 16 * (warp & 3);
  const int lim[2] = {limit(wrow + g), limit(wrow + g + 8)};
  const int lim_lo = limit(wrow);  // a tile reaching past the warp's first row's limit needs the mask

  float o[HD / 2], s[kWgKeys / 2];
#pragma unroll
  for (int i = 0; i < HD / 2; ++i) o[i] = 0.0f;
  uint32_t pa[4][4], pb[4][4];  // P of alternate tiles
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, alpha[2];

  const uint32_t qa = sbase + wg * 64 * 128;
  // Descriptors as a base plus constant offsets (the start address is the low field, in 16-byte units); the base
  // passes through an opaque move so that the compiler recomputes the sums instead of keeping 40 of them live.
  auto opaque = [](uint64_t d) {
    asm volatile("mov.b64 %0, %0;" : "+l"(d));
    return d;
  };
  auto qk = [&](int it) {  // S = Q·K_itᵀ, one group
    const uint64_t dq = opaque(smem_desc(qa)), dk = opaque(smem_desc(sbase + koff(it)));
#pragma unroll
    for (int kk = 0; kk < HD / 16; ++kk)
      Wgmma<64>::ss(s, dq + ((kk >> 2) * kWgRows * 128 + (kk & 3) * 32) / 16,
                    dk + ((kk >> 2) * L::kBlk + (kk & 3) * 32) / 16, kk > 0);
    wgmma_commit();
  };
  auto pv = [&](int it, const uint32_t(&p)[4][4]) {  // O += P·V_it, one group
    const uint64_t dv = opaque(smem_desc(sbase + voff(it), L::kBlk));
#pragma unroll
    for (int kk = 0; kk < kWgKeys / 16; ++kk)
#pragma unroll
      for (int h = 0; h < NPV; ++h)
        Wgmma<PN>::template rs<1>(o + h * PN / 2, p[kk], dv + (kk * 2048 + h * (PN / 64) * L::kBlk) / 16, 1);
    wgmma_commit();
  };
  // The online softmax of tile it (alpha: the factor for O, applied once this tile's P·V is retired), then p = the
  // bf16 A fragments of P.
  auto softmax = [&](int it, uint32_t(&p)[4][4]) {
    const int kb = k0 + it * kWgKeys;
    float base[2];
    softmax_max<kWgKeys / 8>(s, kb, lim, kb + kWgKeys > lim_lo, a.sl2, m, l, base,
                             [&](int i, float f) { alpha[i] = f; });
    softmax_exp<kWgKeys / 8>(s, base, l);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int u = 0; u < 4; ++u) p[kk][u] = pack_bf16(s[8 * kk + 2 * u], s[8 * kk + 2 * u + 1]);
  };

  auto landed = [&]() {  // this thread's copies (the newest group) visible to every thread and to wgmma
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
  };
  cp_async_wait<1>();  // Q and K_0
  fence_proxy_async();
  __syncthreads();
  wgmma_fence();
  qk(0);
  wgmma_wait<0>();
  fence_acc(s);
  softmax(0, pa);
  // One tile: P·V of tile it (P in pc) while S of tile it+1 is computed and softmaxed into pn. P alternates between
  // two register sets, so the softmax never writes registers an in-flight wgmma reads.
  auto step = [&](int it, const uint32_t(&pc)[4][4], uint32_t(&pn)[4][4]) {
    landed();  // K_{it+1} and V_it; every warpgroup is done with K_it and V_{it−1}, whose stages are refilled
    load(k_cache, koff(it), it + 2);
    load(v_cache, voff(it + 1), it + 1);
    cp_async_commit();
    wgmma_fence();
    qk(it + 1);
    pv(it, pc);
    wgmma_wait<1>();  // S of tile it+1 (the older group) done; P·V of tile it still running
    fence_acc(s);
    softmax(it + 1, pn);
    wgmma_wait<0>();
    fence_acc(o);
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) {
      o[4 * n] *= alpha[0], o[4 * n + 1] *= alpha[0];
      o[4 * n + 2] *= alpha[1], o[4 * n + 3] *= alpha[1];
    }
  };
  auto last = [&](int it, const uint32_t(&pc)[4][4]) {  // no branch around a wgmma: the final P·V on its own
    landed();
    wgmma_fence();
    pv(it, pc);
    wgmma_wait<0>();
    fence_acc(o);
  };
  int it = 0;
  for (; it + 2 < ntiles; it += 2) {
    step(it, pa, pb);
    step(it + 1, pb, pa);
  }
  if (it + 1 < ntiles) {
    step(it, pa, pb);
    last(it + 1, pb);
  } else {
    last(it, pa);
  }
  if (wrow < nrows) store_rows<HD>(a, kvh, wrow, o, m, l, qg, out, po, pml);
#else
  __trap();
#endif
}

// ---- split-K combine: one block per (t, h); thread = (float4 column, group of splits) --------------------------
// blockDim = HD/4 · NG, NG = min(S, kCombineGroups). Each thread merges its splits s ≡ group (mod NG) online
// (running max), then the groups merge through shared memory: every partial is loaded in about one round trip.
__global__ void __launch_bounds__(kMaxHD / 4 * kCombineGroups) attn_combine_kernel(const KArgs a,
                                                                                 const float* __restrict__ po,
                                                                                 const float* __restrict__ pml,
                                                                                 const bf16* __restrict__ qg,
                                                                                 bf16* __restrict__ out) {
  pdl_trigger();
  pdl_wait();
  __shared__ float red_m[kCombineGroups], red_l[kCombineGroups];
  __shared__ float4 red_o[kCombineGroups][kMaxHD / 4];
  const int t = blockIdx.x / a.NH, h = blockIdx.x % a.NH, kvh = h / a.G, r = t * a.G + h % a.G;
  const int q4 = a.HD / 4, d4 = threadIdx.x % q4, cg = threadIdx.x / q4, ng = blockDim.x / q4;
  const int pos0 = cur_pos0(a), chunk = split_chunk(pos0 + a.T, a.S);
  const int n_row = min(pos0 + t + 1, a.cache_cap);
  const int ns = min(a.S, (n_row + chunk - 1) / chunk);  // splits holding ≥ 1 key this row sees (so m is finite)
  const size_t row = size_t(t) * a.NH + h;
  uint2 gv = make_uint2(0u, 0u);
  if (cg == 0) gv = *reinterpret_cast<const uint2*>(qg + (row * 2 + 1) * a.HD + 4 * d4);  // gate, early
  float M = -INFINITY, L = 0.0f;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 2
  for (int s = cg; s < ns; s += ng) {
    const size_t pr = (size_t(s) * a.NKV + kvh) * a.Rpad + r;
    const float2 ml = *reinterpret_cast<const float2*>(pml + pr * 2);
    const float4 p = reinterpret_cast<const float4*>(po + pr * a.HD)[d4];
    const float mn = fmaxf(M, ml.x), fo = exp2f(M - mn), fs = exp2f(ml.x - mn);
    L = L * fo + ml.y * fs;
    acc.x = acc.x * fo + p.x * fs, acc.y = acc.y * fo + p.y * fs;
    acc.z = acc.z * fo + p.z * fs, acc.w = acc.w * fo + p.w * fs;
    M = mn;
  }
  if (d4 == 0) red_m[cg] = M, red_l[cg] = L;
  red_o[cg][d4] = acc;
  __syncthreads();
  if (cg != 0) return;
  float Mx = -INFINITY;
  for (int j = 0; j < ng; ++j) Mx = fmaxf(Mx, red_m[j]);  // finite: group 0 holds split 0
  float Lx = 0.0f;
  float4 o = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j = 0; j < ng; ++j) {
    const float f = exp2f(red_m[j] - Mx);  // 0 for a group without splits
    const float4 b = red_o[j][d4];
    Lx += f * red_l[j];
    o.x += f * b.x, o.y += f * b.y, o.z += f * b.z, o.w += f * b.w;
  }
  const float inv = 1.0f / Lx;
  const float2 g01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gv.x));
  const float2 g23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&gv.y));
  const __nv_bfloat162 lo = __floats2bfloat162_rn(o.x * inv * sigmoidf_(g01.x), o.y * inv * sigmoidf_(g01.y));
  const __nv_bfloat162 hi = __floats2bfloat162_rn(o.z * inv * sigmoidf_(g23.x), o.w * inv * sigmoidf_(g23.y));
  uint2 u;
  u.x = *reinterpret_cast<const uint32_t*>(&lo);
  u.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(out + row * a.HD + 4 * d4) = u;
}

// ---- launch helpers ----------------------------------------------------------------------------------------
template <int HD, int RW, int KW, int NSTAGE, bool EARLY>
void launch_mma(Ctx& ctx, const KArgs& ka, int row_tiles, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                const bf16* qg, bf16* out, float* po, float* pml) {
  constexpr size_t smem = size_t(16 * RW + 2 * NSTAGE * kBC) * (HD + 8) * sizeof(bf16);
  LILY_CHECK(smem <= ctx.smem_optin, "attention: HD=", HD, " needs ", smem, " bytes of shared memory, the device has ",
             ctx.smem_optin);
  allow_smem(ctx, attn_mma_kernel<HD, RW, KW, NSTAGE, EARLY>, smem);
  launch(ctx, attn_mma_kernel<HD, RW, KW, NSTAGE, EARLY>, dim3(row_tiles, ka.NKV, ka.S), 32 * RW * KW, smem, ka, q,
         k_cache, v_cache, qg, out, po, pml);
}

// The prefill instance on wgmma: built for sm_90a, on a 9.0 device, switch attn_wgmma, whole 128-byte rows.
template <int HD>
bool wgmma_applies(const Ctx& ctx) {
#ifdef LILY_CUDA_SM90A
  return HD % 64 == 0 && ctx.sm90a && ctx.opts.on(Opt::attn_wgmma);
#else
  (void)ctx;
  return false;
#endif
}

template <int HD>
void launch_wgmma(Ctx& ctx, const KArgs& ka, int row_tiles, const bf16* q, const bf16* k_cache, const bf16* v_cache,
                  const bf16* qg, bf16* out, float* po, float* pml) {
  if constexpr (HD % 64 == 0) {
    constexpr int smem = WgLayout<HD>::kBytes;
    LILY_CHECK(size_t(smem) <= ctx.smem_optin, "attention: HD=", HD, " needs ", smem,
               " bytes of shared memory, the device has ", ctx.smem_optin);
    allow_smem(ctx, attn_wgmma_kernel<HD>, smem);
    launch(ctx, attn_wgmma_kernel<HD>, dim3(row_tiles, ka.NKV, ka.S), 256, smem, ka, q, k_cache, v_cache, qg, out,
           po, pml);
  }
}

template <int HD>
void run_attention(Ctx& ctx, KArgs ka, const bf16* q, const bf16* k_cache, const bf16* v_cache, const bf16* qg,
                   bf16* out) {
  const bool decode = ka.T * ka.G <= kDecodeMaxRows;
  const int BM = decode ? 16 : 128;
  const int row_tiles = int(cdiv(int64_t(ka.T) * ka.G, BM));
  const int blocks = row_tiles * ka.NKV;
  // Below one wave of blocks, split the keys until the grid fills the GPU (decode: one 4-warp block per SM;
  // prefill: two waves of 8-warp blocks), each split keeping a useful length. Host values only: with pos_dev
  // the grid is sized from cache_cap and the kernels size the splits from the device position.
  const int64_t max_keys = ka.pos_dev ? ka.cache_cap : int64_t(ka.pos0) + ka.T;
  const int64_t target = decode ? ctx.num_sms : 2 * ctx.num_sms;
  const int min_keys = decode && ctx.opts.on(Opt::attn_short_splits) ? kMinDecodeSplitKeys : kMinSplitKeys;
  int64_t S = blocks >= ctx.num_sms ? 1 : std::min<int64_t>(cdiv(target, blocks), cdiv(max_keys, min_keys));
  ka.S = int(std::max<int64_t>(1, std::min<int64_t>(S, kMaxSplits)));
  ka.Rpad = row_tiles * BM;
  float *po = nullptr, *pml = nullptr;
  if (ka.S > 1) {
    const size_t rows = size_t(ka.S) * ka.NKV * ka.Rpad;
    po = static_cast<float*>(ctx.scratch(kSlotAttnPartial, rows * (HD + 2) * sizeof(float)));
    pml = po + rows * HD;
  }
  if (decode) {
    if (ctx.opts.on(Opt::attn_kv_early))
      launch_mma<HD, 1, 4, 3, true>(ctx, ka, row_tiles, q, k_cache, v_cache, qg, out, po, pml);
    else
      launch_mma<HD, 1, 4, 3, false>(ctx, ka, row_tiles, q, k_cache, v_cache, qg, out, po, pml);
    check_launch("attn_mma");
  } else if (wgmma_applies<HD>(ctx)) {
    launch_wgmma<HD>(ctx, ka, row_tiles, q, k_cache, v_cache, qg, out, po, pml);
    check_launch("attn_wgmma");
  } else {
    launch_mma<HD, 8, 1, 2, false>(ctx, ka, row_tiles, q, k_cache, v_cache, qg, out, po, pml);
    check_launch("attn_mma");
  }
  if (ka.S > 1) {
    const int groups = std::min(ka.S, kCombineGroups);
    launch(ctx, attn_combine_kernel, ka.T * ka.NH, HD / 4 * groups, 0, ka, po, pml, qg, out);
    check_launch("attn_combine");
  }
}

}  // namespace

void attention(Ctx& ctx, const AttnArgs& a, const bf16* qg, const bf16* k, const bf16* v, const float* q_norm,
               const float* k_norm, bf16* k_cache, bf16* v_cache, bf16* out) {
  check_attention(a);
  LILY_CHECK(int64_t(a.T) * a.NH <= INT32_MAX && int64_t(a.cache_cap) * a.NKV * a.HD <= (int64_t(1) << 40),
             "attention: shape too large (T=", a.T, ", cache_cap=", a.cache_cap, ")");
  KArgs ka{};
  ka.T = a.T, ka.NH = a.NH, ka.NKV = a.NKV, ka.G = a.NH / a.NKV, ka.HD = a.HD;
  ka.pos0 = a.pos0, ka.cache_cap = a.cache_cap, ka.pos_dev = a.pos_dev;
  ka.sl2 = 1.0f / std::sqrt(float(a.HD)) * 1.44269504088896341f;
  ka.eps = a.eps, ka.R = a.rotary_dim;
  ka.S = 1;

  bf16* q = static_cast<bf16*>(ctx.scratch(kSlotAttnQ, size_t(a.T) * a.NH * a.HD * sizeof(bf16)));
  const int64_t items = int64_t(a.T) * (a.NH + a.NKV);
  RopeFreq rf{};
  for (int i = 0; i < a.rotary_dim / 2; ++i)
    rf.inv_freq[i] = std::pow(a.rope_theta, -2.0f * float(i) / float(a.rotary_dim));
  launch(ctx, attn_prep_kernel, unsigned(cdiv(items, kPrepWarps)), 32 * kPrepWarps, 0, ka, rf, qg, k, v, q_norm,
         k_norm, k_cache, v_cache, q);
  check_launch("attn_prep");

  switch (a.HD) {
    case 32: run_attention<32>(ctx, ka, q, k_cache, v_cache, qg, out); break;
    case 64: run_attention<64>(ctx, ka, q, k_cache, v_cache, qg, out); break;
    case 128: run_attention<128>(ctx, ka, q, k_cache, v_cache, qg, out); break;
    default: run_attention<256>(ctx, ka, q, k_cache, v_cache, qg, out); break;
  }
}

}  // namespace lily::cuda
