// attention_args.h: the argument structs of metal/attention.metal, shared by the kernels and their launcher
// (csrc/backend/metal/attention.cpp), and the tile shape of attn_main that both sides derive from the head dim.
// Plain int/float fields only, so the layout is the same in MSL and C++.
#pragma once

#define ATTN_MAX_HD 256
#define ATTN_PREP_SG 4     // attn_prep: simdgroups (items) per threadgroup
#define ATTN_NT 128        // attn_main: threads per threadgroup (4 simdgroups)
#define ATTN_COMBINE_NT 128  // attn_combine: threads per threadgroup

// attn_main tile: BM packed query rows (row r = t·G + j of one kv head) against key tiles of BC keys. Q (fp32) + the
// K, V tiles (bf16) + the scores stay under Apple's 32 KB of threadgroup memory: 24.6 KB at HD = 256, 26.1 KB at 128.
// The decode tile (switch attn_decode_tile: at most ATTN_DECODE_BM packed rows per kv head, HD ≥ 64) is 8 rows and
// 16 keys, so that no thread scores or accumulates rows past the token's G query heads: 25.2 KB at HD = 256.
#define ATTN_DECODE_BM 8
constexpr int attn_bm(int hd, bool decode) { return decode ? ATTN_DECODE_BM : hd == 256 ? 16 : 32; }
constexpr int attn_bc(int hd, bool decode) { return decode ? 16 : hd == 256 ? 8 : hd == 128 ? 16 : 32; }

// attn_simdgroup tile (switch attn_simdgroup, prefill): ATTN_SG_BM packed rows as 4 blocks of 8, each block's scores
// and output split over two simdgroups by head-dim half; key tiles of attn_sg_bc keys staged as fp32 (Kᵀ and V), so
// that a tile of either is 8 KB at most. Threadgroup memory: 24.9 KB at HD = 256, 28.3 KB at HD = 64 (the largest).
#define ATTN_SG_NT 256     // attn_simdgroup: threads per threadgroup (8 simdgroups)
#define ATTN_SG_BM 32      // attn_simdgroup: packed rows per threadgroup
#define ATTN_SG_MIN_ROWS 32  // the launcher takes attn_simdgroup from this many packed rows per kv head (T·G)
constexpr int attn_sg_bc(int hd) { return hd == 256 ? 8 : hd == 128 ? 16 : 32; }
// Floats of the staging tile: Kᵀ [HD][BC + 4] and V [BC][HD + 4] while the keys run; Q and then O, one head-dim half
// at a time, as [BM][HD/2 + 4] before and after.
constexpr int attn_sg_tile(int hd) {
  return hd * (attn_sg_bc(hd) + 4) + attn_sg_bc(hd) * (hd + 4) > ATTN_SG_BM * (hd / 2 + 4)
             ? hd * (attn_sg_bc(hd) + 4) + attn_sg_bc(hd) * (hd + 4)
             : ATTN_SG_BM * (hd / 2 + 4);
}

// attn_prep: q/k RMSNorm, RoPE, cache append. One item = one (token, q head) or (token, kv head).
struct AttnPrepArgs {
  int T, NH, NKV, HD;
  int R;          // rotary dims (the first R of each head, rotate-half pairs (i, i + R/2))
  int cache_cap;  // cache rows; a k/v row at or past it is never written
  float eps;      // q/k RMSNorm epsilon
  float inv_freq[ATTN_MAX_HD / 2];  // θ_i = theta^(−2i/R), computed on the host exactly as the CPU reference
};

// attn_main_* / attn_split_* / attn_combine.
struct AttnMainArgs {
  int T, NH, NKV, G, HD;  // G = NH / NKV query heads per kv head
  int cache_cap;
  int S;           // key splits (grid z); 1 = no split, attn_main writes the gated output itself
  int block;       // keys per split (a multiple of BC); split z covers keys z·block .. z·block + block − 1
  int Rpad;        // packed rows per kv head rounded up to BM (row stride of the partials)
  float scale_log2;  // HD^-1/2 · log2(e): scores live in the log2 domain
};
