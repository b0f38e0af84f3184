#include "core/optimisations.h"

#include "core/common.h"

namespace lily {

const std::vector<OptInfo>& optimisation_table() {
  static const std::vector<OptInfo> table = {
      {Opt::pdl, "pdl", "cuda",
       "decode step: programmatic dependent launch, each kernel loads its weights while the previous one drains"},
      {Opt::gdn_chunked, "gdn_chunked", "cuda,metal",
       "Gated DeltaNet prefill: chunks of 64 tokens in the WY form on tensor cores / simdgroup matrices, not token "
       "by token"},
      {Opt::moe_sort_scan, "moe_sort_scan", "cuda,metal",
       "MoE prefill: routed rows sorted by one histogram and scan in one block (CUDA: instead of one pass over them "
       "per expert; Metal: one dispatch instead of three)"},
      {Opt::qmv_stream, "qmv_stream", "cuda",
       "decode GEMV: persistent warps stream two-row units (two in flight each) instead of one wave of row blocks"},
      {Opt::moe_tiles_128, "moe_tiles_128", "cuda",
       "MoE prefill GEMMs: 128-row tiles from 96 rows per expert on average (else 64-row tiles below 256)"},
      {Opt::wgmma, "wgmma", "cuda",
       "prefill GEMMs (dense and expert) on Hopper's wgmma, weights dequantised into registers, instead of mma.sync "
       "from a dequantised shared-memory tile"},
      {Opt::qmv_mma, "qmv_mma", "cuda",
       "GEMMs of 9 to 16 tokens (a short prompt tail) as one pass over the weights on the tensor cores, the codes "
       "dequantised in registers, instead of the tile GEMMs, which launch a quarter of the SMs' worth of blocks there"},
      {Opt::attn_wgmma, "attn_wgmma", "cuda",
       "prefill attention on Hopper's wgmma, the next key tile's scores computed while this tile's P·V runs, instead "
       "of the mma.sync flash kernel"},
      {Opt::gdn_wy_mma, "gdn_wy_mma", "cuda",
       "chunked Gated DeltaNet prefill: each chunk's WY form with K·Kᵀ and Q·Kᵀ on tensor cores, its operands "
       "copied in one batch and a right-looking triangular solve, instead of fp32 products and a left-looking solve"},
      {Opt::moe_shared_stream, "moe_shared_stream", "cuda",
       "MoE prefill: the shared expert's GEMMs on a second stream beside the router, the routing, the sort and the "
       "routed experts, instead of after them"},
      {Opt::moe_tiles_16, "moe_tiles_16", "cuda",
       "Hopper expert GEMMs of at most 16 tokens (a short prompt tail) in a kernel with only the 16-row tile, two "
       "blocks per SM, instead of the kernel with every tile size at one block per SM"},
      {Opt::route_fused, "route_fused", "cuda,metal",
       "decode MoE: the top-k routing done by the expert gate+up kernel itself from the router logits (each warp "
       "the rounds up to its slot; one block writes the routing and the shared gate for the down kernel), instead "
       "of a routing kernel between the router and the experts"},
      {Opt::gdn_prep_fused, "gdn_prep_fused", "cuda,metal",
       "decode: a token's Gated DeltaNet recurrence in one kernel, each block normalising its head's q and k and "
       "computing its gates itself, instead of a prep kernel that hands them on through scratch (Metal's scan "
       "always did; there the switch takes the one-token kernels of the two below with it)"},
      {Opt::gdn_norm_fused, "gdn_norm_fused", "cuda,metal",
       "decode: a token's Gated DeltaNet output norm (rms_norm(y)·w·silu(z) per head) done by the one-token scan "
       "kernel, one block / threadgroup per head, instead of a norm kernel after it (only with gdn_prep_fused on)"},
      {Opt::gdn_conv_fused, "gdn_conv_fused", "metal",
       "decode: a token's Gated DeltaNet conv done by the one-token scan kernel too, one threadgroup per key head "
       "(its value heads share the q/k channels' state), instead of a conv dispatch before it (only with "
       "gdn_norm_fused on)"},
      {Opt::route_logits, "route_logits", "cuda,metal",
       "decode MoE (with route_fused): each routed warp / simdgroup picks the top-k on the router logits, which the softmax keeps "
       "in order, by a three-level tree over its lane's candidates, and only the weights take the softmax, instead of "
       "the softmax of every logit before rounds that scan each lane's candidates in a chain"},
      {Opt::attn_short_splits, "attn_short_splits", "cuda",
       "decode attention: key splits of at least 64 keys instead of 256, so that a short context fills the SMs (at "
       "4K, 66 splits instead of 17)"},
      {Opt::qmv_dp4a, "qmv_dp4a", "cuda",
       "decode GEMV (streaming): the 4- and 8-bit dot products as integer dp4a on x staged in 16-bit fixed point per "
       "16-byte code chunk (exact for every element within 2^7 of its chunk's largest), instead of fp32 FMAs on "
       "codes turned into floats: a quarter of the instructions per code"},
      {Opt::moe_dp4a, "moe_dp4a", "cuda",
       "decode MoE: the gate+up kernel's dot products on dp4a the same way, each block staging m once in shared "
       "memory in 16-bit fixed point, instead of every lane holding its chunks of m as fp32 in registers"},
      {Opt::sample_cluster, "sample_cluster", "cuda",
       "decode token selection by a cluster of 16 blocks, each id's logit read once into a register and the blocks' "
       "maxima, sums, radix histograms and candidate counts met through distributed shared memory, instead of one "
       "block passing over the logits seven times"},
      {Opt::norm_fold, "norm_fold", "cuda,metal",
       "decode: the post-mixer residual add and RMSNorm folded into the GEMVs around them (the mixer's output "
       "projection adds into x and leaves x·w and per-block sums of x²; the router stages x·w and scales its dot "
       "products by the norm's 1/sqrt(mean(x²) + eps), writing m for the experts), instead of a norm kernel"},
      {Opt::attn_simdgroup, "attn_simdgroup", "metal",
       "prefill attention with its two products (Q·Kᵀ, P·V) on simdgroup matrices, the keys and values staged as fp32 "
       "tiles, instead of scalar fp32 dot products over the same tiles"},
      {Opt::attn_decode_tile, "attn_decode_tile", "metal",
       "decode attention (at most 8 packed query rows per kv head) on a tile of 8 rows and 16 keys instead of the "
       "prefill tile of 16 or 32 rows, so that no thread works for rows past the token's query heads"},
      {Opt::sample_split, "sample_split", "metal",
       "decode token selection in two dispatches: threadgroups each reading a slice of 4096 logits once (maxima, "
       "Σexp, argmax and the slice's own top-k candidates), then one threadgroup selecting among their union, "
       "instead of one threadgroup passing over the logits seven times"},
      {Opt::moe_down_early, "moe_down_early", "cuda",
       "decode MoE: the down kernel's routed warps take the expert ids as soon as the gate+up kernel's routing block "
       "releases them and load their codes before the PDL wait, instead of after it"},
      {Opt::attn_kv_early, "attn_kv_early", "cuda",
       "decode attention: the first key/value tiles' cached rows (those before the token's position, written by "
       "earlier steps) copied before the PDL wait, this step's own rows after it, instead of every copy after the "
       "wait"},
  };
  return table;
}

std::string Optimisations::disabled_names() const {
  std::string s;
  for (const OptInfo& o : optimisation_table())
    if (!on(o.id)) s += (s.empty() ? "" : ",") + std::string(o.name);
  return s;
}

Optimisations Optimisations::with_disabled(const std::vector<std::string>& names) {
  Optimisations o;
  for (const std::string& n : names) {
    if (n.empty()) continue;
    bool found = false;
    for (const OptInfo& info : optimisation_table()) {
      if (n == info.name) {
        o.disable(info.id);
        found = true;
      }
    }
    if (!found) {
      std::string known;
      for (const OptInfo& info : optimisation_table()) known += (known.empty() ? "" : ", ") + std::string(info.name);
      throw InputError(cat("unknown optimisation '", n, "' (known: ", known, ")"));
    }
  }
  return o;
}

}  // namespace lily
