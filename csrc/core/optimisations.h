// optimisations.h: the ablation switches. Every optimisation a backend makes beyond its plain, tested path has a
// name here and can be turned off alone (LILY_DISABLE=name,… or lily.load(…, disable=[…])), so that its worth is
// measured by the difference it makes (benchmarks/bench_model.py --ablate, benchmarks/NOTES.md). Off means the
// plain path, which the op and end-to-end tests also run.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lily {

enum class Opt : int {
  pdl,               // CUDA: programmatic dependent launch in the replayed decode step (weights load early). Metal
                     //   has no equivalent: a dispatch that reads an earlier one's output starts after the encoder's
                     //   barrier (metal_backend.mm), and only independent dispatches overlap
  gdn_chunked,       // CUDA, Metal: Gated DeltaNet prefill in chunks of 64 tokens (WY form) on tensor cores /
                     //   simdgroup matrices; the rule of when it runs is backend/policy.h's gdn_chunked
  moe_sort_scan,     // CUDA, Metal: MoE prefill routing sorted by one histogram + scan in one block
  qmv_stream,        // CUDA: decode GEMV as persistent warps streaming two-row units, two in flight each (not on Metal:
                     //   benchmarks/NOTES.md, Metal)
  moe_tiles_128,     // CUDA: MoE prefill GEMMs in 128-row tiles from 96 rows per expert (else from 256); Metal's
                     //   grouped GEMM picks its own 16/32-row tiles (metal/qmm.metal)
  wgmma,             // CUDA: prefill GEMMs (dense and expert) on Hopper's wgmma with the weights dequantised into
                     //   registers (qmm_sm90.cu) instead of mma.sync from a dequantised shared-memory tile. Metal has
                     //   no such instruction: its GEMMs use simdgroup matrices already (metal/qmm.metal)
  qmv_mma,           // CUDA: GEMMs of 9–16 tokens (a short prompt tail, e.g. the assistant header the server prefills
                     //   after snapshotting a new conversation's opening turn) as one tensor-core GEMV pass, the codes
                     //   dequantised in registers, instead of the tile GEMMs. Metal: its GEMV takes up to 8 tokens;
                     //   not ported (benchmarks/NOTES.md, Metal)
  attn_wgmma,        // CUDA: prefill attention on Hopper's wgmma (S and P·V as warpgroup MMAs, the next tile's S
                     //   overlapping this tile's P·V) instead of the mma.sync flash kernel. Not on Metal: no asynchronous
                     //   MMA to overlap with (benchmarks/NOTES.md, Metal)
  gdn_wy_mma,        // CUDA: the chunked GDN's per-chunk WY form with its products on tensor cores, its operands copied
                     //   in one cp.async batch and a right-looking triangular solve, instead of fp32 products and a
                     //   left-looking solve. Metal's gdn_wy has simdgroup-matrix products already (benchmarks/NOTES.md)
  moe_shared_stream, // CUDA: a prefill chunk's shared expert (three GEMMs) on a second stream beside the router, the
                     //   routing, the sort and the routed GEMMs. Metal: its concurrent encoder already overlaps
                     //   independent dispatches (metal_backend.mm)
  moe_tiles_16,      // CUDA: the Hopper expert GEMMs of ≤ 16 tokens (a short prompt tail: every expert holds ≤ 16 rows)
                     //   as a kernel with the 16-row tile alone, two blocks per SM, instead of the one with all four
                     //   tiles at one block per SM. Metal's grouped GEMM is one instance per tile height already
                     //   (metal/qmm.metal)
  route_fused,       // CUDA, Metal: decode MoE routing inside the gate+up kernel (each routed warp / simdgroup runs the
                     //   top-k up to its slot from the router logits; one block writes the routing and γ for the down
                     //   kernel) instead of a routing kernel between the router and the experts
  gdn_prep_fused,    // CUDA: a decode token's Gated DeltaNet recurrence in one kernel, each block normalising its head's
                     //   q and k and computing its gates itself, instead of a prep kernel handing them on through
                     //   scratch. Metal: its scan always normalises in the kernel; the switch gates the one-token
                     //   kernels below (backend/policy.h: gdn_token_path)
  gdn_norm_fused,    // CUDA, Metal: a decode token's gated RMSNorm (o = rms_norm(y)·w·silu(z) per head) done by the
                     //   one-token scan kernel, one block / threadgroup per head, instead of a norm kernel after it
                     //   (needs gdn_prep_fused)
  gdn_conv_fused,    // Metal: a decode token's causal conv done by the one-token scan kernel too (with
                     //   gdn_norm_fused), instead of a conv dispatch before it, one threadgroup per key head (the value
                     //   heads of a key head share its q/k channels' state). CUDA's form measured < 1 %: removed
  route_logits,      // CUDA, Metal: the decode MoE routing inside the gate+up kernel (route_fused) picks the top-k on the
                     //   router logits (softmax is monotonic) by a tree per lane, the softmax only for the picked
                     //   weights, instead of rounds over the probabilities
  attn_short_splits, // CUDA: decode attention's key splits at least kMinDecodeSplitKeys (64) keys long instead of 256,
                     //   so that a short context fills the SMs (4K: 66 splits of 64 keys instead of 17 of 256)
  qmv_dp4a,          // CUDA: the streaming decode GEMV's dot products as integer dp4a on x staged in 16-bit fixed
                     //   point per code chunk, instead of fp32 FMAs on codes turned into floats. Not on Metal: Apple
                     //   GPUs have no integer dot-product instruction (benchmarks/NOTES.md, Metal)
  moe_dp4a,          // CUDA: the decode MoE's gate+up dot products the same way, each block staging m once in shared
                     //   memory as x16, instead of every lane holding its chunks of m as fp32. Not on Metal (as above)
  sample_cluster,    // CUDA: token selection on a cluster of 16 blocks, every logit read once into registers and the
                     //   block results met through distributed shared memory, instead of one block passing over the
                     //   logits seven times. Not on Metal (no thread-block clusters): sample_split there
  norm_fold,         // CUDA, Metal: a decode token's post-mixer residual add and RMSNorm folded into the GEMVs
                     //   around them: the mixer's output projection adds into x and leaves x ⊙ w and per-block Σx²,
                     //   and the router's GEMV stages x ⊙ w and scales its sums by 1/sqrt(mean(x²) + eps) (writing m
                     //   for the experts), instead of a norm kernel between them
  attn_simdgroup,    // Metal: prefill attention (from ATTN_SG_MIN_ROWS packed rows per kv head) with Q·Kᵀ and P·V
                     //   on simdgroup matrices (metal/attention.metal attn_sg) instead of scalar fp32 tiles. CUDA's
                     //   prefill attention is on tensor cores already (attention.cu attn_mma_kernel, attn_wgmma)
  attn_decode_tile,  // Metal: decode attention (≤ ATTN_DECODE_BM packed rows per kv head, HD ≥ 64) on a tile of 8 rows
                     //   and 16 keys instead of the prefill tile of 16 or 32 rows, whose rows past the token's G
                     //   query heads are scored and accumulated for nothing. CUDA's decode packs the G rows into
                     //   tensor-core tiles (attention.cu)
  sample_split,      // Metal: decode token selection in two dispatches, sample_part's threadgroups each reading a slice
                     //   of 4096 logits once (maxima, Σexp, argmax, the slice's own top-k candidates) and sample_merge
                     //   selecting among their union, instead of one threadgroup passing over the logits seven
                     //   times. CUDA's answer is sample_cluster (one dispatch: a cluster meets through DSMEM)
  moe_down_early,    // CUDA (with route_fused): the decode MoE's down kernel takes the expert ids as soon as the
                     //   gate+up kernel's routing block releases them (a tag the block stores, one per MoE call) and
                     //   loads its routed codes before its PDL wait, instead of after it. Metal: no PDL, a dispatch
                     //   starts after its predecessor ends (as pdl)
  attn_kv_early,     // CUDA: decode attention copies its first key/value tiles' rows before the current position (the
                     //   cache as earlier forwards left it) before its PDL wait, and only this forward's rows after it,
                     //   instead of every copy after the wait. Metal: no PDL (as pdl)
  kCount
};

struct OptInfo {
  Opt id;
  const char* name;
  const char* backends;  // where it changes anything
  const char* what;      // one line
};

// Every switch, in enum order.
const std::vector<OptInfo>& optimisation_table();

// The set of switches that are on. Default: all.
class Optimisations {
 public:
  bool on(Opt o) const { return !((off_ >> int(o)) & 1u); }
  void disable(Opt o) { off_ |= uint64_t(1) << int(o); }
  // Names of the disabled switches, comma-separated, in table order ("" when all are on).
  std::string disabled_names() const;
  // From switch names; an unknown name is an InputError that lists the known ones.
  static Optimisations with_disabled(const std::vector<std::string>& names);
  bool operator==(const Optimisations& o) const { return off_ == o.off_; }

 private:
  uint64_t off_ = 0;
};

}  // namespace lily
