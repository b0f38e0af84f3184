// attention.cpp: the Metal launcher of the gated full-attention mixer (metal/attention.metal, whose header gives the
// math, the mapping and the split rule). attn_prep, then attn_main_hd<HD> (or attn_split_hd<HD> + attn_combine); with
// the switch attn_simdgroup and at least ATTN_SG_MIN_ROWS packed rows per kv head, attn_sg_hd<HD> (or
// attn_sg_split_hd<HD>) in their place: the same splits, partials and combine, another row tile. With the switch
// attn_decode_tile, a call of at most ATTN_DECODE_BM packed rows per kv head (decode) takes attn_main_hd<HD>_r8 (or
// attn_split_hd<HD>_r8): the scalar kernel on a tile of 8 rows and 16 keys.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "../../../metal/attention_args.h"
#include "backend/checks.h"
#include "backend/metal/ops.h"
#include "core/common.h"

namespace lily::metal {

namespace {

constexpr int kSplitBlock = 512;     // keys per split block (fixed; a multiple of every attn_bc)
constexpr int kLongContext = 32768;  // from this many keys on, the keys are always split
constexpr int kMinGroups = 64;       // fewer threadgroups than this leave GPU cores idle: split the keys
constexpr int64_t kMaxPartialFloats = int64_t(1) << 24;  // 64 MB of fp32 partials at most (a block grows to fit)

// The position the kernels read: the device copy when the step is replayed, else pos0 bound as bytes.
void bind_pos(Encoder& enc, int index, const AttnArgs& a) {
  if (a.pos_dev)
    enc.set_buffer(index, a.pos_dev);
  else
    enc.set_bytes(index, &a.pos0, sizeof(int32_t));
}

}  // namespace

void attention(Encoder& enc, const Optimisations& opts, const AttnArgs& a, const uint16_t* qg, const uint16_t* k,
               const uint16_t* v, const float* q_norm, const float* k_norm, uint16_t* k_cache, uint16_t* v_cache,
               uint16_t* out) {
  check_attention(a);
  LILY_CHECK(int64_t(a.cache_cap) * a.NKV * a.HD <= INT32_MAX && int64_t(a.T) * a.NH * 2 * a.HD <= INT32_MAX,
             "attention: shape too large for 32-bit indices (T=", a.T, ", cache_cap=", a.cache_cap, ")");
  LILY_CHECK(reinterpret_cast<uintptr_t>(k_cache) % 8 == 0 && reinterpret_cast<uintptr_t>(v_cache) % 8 == 0,
             "attention: k_cache and v_cache must be 8-byte aligned");
  const int G = a.NH / a.NKV;

  // 1. q/k norm, RoPE, cache append; q (fp32) to scratch.
  AttnPrepArgs pa{};
  pa.T = a.T, pa.NH = a.NH, pa.NKV = a.NKV, pa.HD = a.HD, pa.R = a.rotary_dim, pa.cache_cap = a.cache_cap;
  pa.eps = a.eps;
  for (int i = 0; i < a.rotary_dim / 2; ++i)  // the reference's own expression (cpu/attention.cpp, rope)
    pa.inv_freq[i] = std::pow(a.rope_theta, -2.0f * float(i) / float(a.rotary_dim));
  float* q = static_cast<float*>(enc.scratch(kSlotAttnQ, size_t(a.T) * a.NH * a.HD * sizeof(float)));
  const int64_t items = int64_t(a.T) * (a.NH + a.NKV);
  enc.kernel("attn_prep");
  enc.set_args(pa);
  bind_pos(enc, 1, a);
  enc.set_buffer(2, qg);
  enc.set_buffer(3, k);
  enc.set_buffer(4, v);
  enc.set_buffer(5, q_norm);
  enc.set_buffer(6, k_norm);
  enc.set_buffer(7, k_cache);
  enc.set_buffer(8, v_cache);
  enc.set_buffer(9, q);
  enc.dispatch({uint32_t((items + ATTN_PREP_SG - 1) / ATTN_PREP_SG), 1, 1}, {32 * ATTN_PREP_SG, 1, 1});

  // 2. attention. Split sizes use host values only: with pos_dev they come from cache_cap, never the position.
  const bool sg = opts.on(Opt::attn_simdgroup) && int64_t(a.T) * G >= ATTN_SG_MIN_ROWS;
  const bool dec = opts.on(Opt::attn_decode_tile) && int64_t(a.T) * G <= ATTN_DECODE_BM && a.HD >= 64;
  const int BM = sg ? ATTN_SG_BM : attn_bm(a.HD, dec), BC = sg ? attn_sg_bc(a.HD) : attn_bc(a.HD, dec);
  const unsigned threads = sg ? ATTN_SG_NT : ATTN_NT;
  const int row_tiles = int((int64_t(a.T) * G + BM - 1) / BM);
  const int64_t groups = int64_t(row_tiles) * a.NKV;
  const int64_t max_keys = a.pos_dev ? a.cache_cap : int64_t(a.pos0) + a.T;
  AttnMainArgs ma{};
  ma.T = a.T, ma.NH = a.NH, ma.NKV = a.NKV, ma.G = G, ma.HD = a.HD, ma.cache_cap = a.cache_cap;
  ma.Rpad = row_tiles * BM;
  ma.scale_log2 = 1.0f / std::sqrt(float(a.HD)) * 1.44269504088896341f;
  ma.S = 1;
  ma.block = (a.cache_cap + BC - 1) / BC * BC;
  if ((max_keys >= kLongContext || groups < kMinGroups) && max_keys > kSplitBlock) {
    int64_t block = kSplitBlock;
    auto splits = [&](int64_t b) { return (max_keys + b - 1) / b; };
    while (splits(block) > 1 && splits(block) * a.NKV * ma.Rpad * (a.HD + 2) > kMaxPartialFloats) block *= 2;
    ma.S = int(splits(block));
    ma.block = int(block);
  }
  const std::string hd = std::to_string(a.HD) + (dec ? "_r8" : "");
  if (ma.S == 1) {
    enc.kernel(((sg ? "attn_sg_hd" : "attn_main_hd") + hd).c_str());
    enc.set_args(ma);
    bind_pos(enc, 1, a);
    enc.set_buffer(2, q);
    enc.set_buffer(3, k_cache);
    enc.set_buffer(4, v_cache);
    enc.set_buffer(5, qg);
    enc.set_buffer(6, out);
    enc.dispatch({uint32_t(row_tiles), uint32_t(a.NKV), 1}, {threads, 1, 1});
    return;
  }
  float* part = static_cast<float*>(
      enc.scratch(kSlotAttnPartial, size_t(ma.S) * a.NKV * ma.Rpad * (a.HD + 2) * sizeof(float)));
  enc.kernel(((sg ? "attn_sg_split_hd" : "attn_split_hd") + hd).c_str());
  enc.set_args(ma);
  bind_pos(enc, 1, a);
  enc.set_buffer(2, q);
  enc.set_buffer(3, k_cache);
  enc.set_buffer(4, v_cache);
  enc.set_buffer(5, part);
  enc.dispatch({uint32_t(row_tiles), uint32_t(a.NKV), uint32_t(ma.S)}, {threads, 1, 1});
  enc.kernel("attn_combine");
  enc.set_args(ma);
  bind_pos(enc, 1, a);
  enc.set_buffer(2, part);
  enc.set_buffer(3, qg);
  enc.set_buffer(4, out);
  enc.dispatch({uint32_t(a.T * a.NH), 1, 1}, {ATTN_COMBINE_NT, 1, 1});
}

}  // namespace lily::metal
