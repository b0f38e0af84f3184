// policy.h: the choices the GPU backends (cuda/, metal/) make the same way, in one place: which token selections run
// on the device, when the Gated DeltaNet scan takes its chunked form, and when a decode token's Gated DeltaNet layer
// runs as one kernel. A backend's kernels may take more than this
// (each launcher checks its own limits); these rules decide which path runs, so that both backends run the same one.
#pragma once
#include "backend/backend.h"
#include "core/optimisations.h"
#include "core/sample.h"

namespace lily {

// ---- token selection on the device (cuda/sample.cu, metal/sample.metal) -------------------------------------------

// The candidates a device sampler holds after top-k (one block / threadgroup of 1024 threads, one each).
constexpr int kSampleMaxCand = 1024;

// Backend::can_sample of both GPU backends: greedy, or a top-k set of at most kSampleMaxCand ids (top_k = 0 keeps
// every valid id); top_logprobs are reported by the host sampler only.
inline bool device_can_sample(const SamplingParams& p, int n_valid) {
  if (p.top_logprobs > 0) return false;
  if (p.temperature == 0.0f) return true;
  const int k = (p.top_k > 0 && p.top_k < n_valid) ? p.top_k : n_valid;
  return k <= kSampleMaxCand;
}

// ---- the chunked Gated DeltaNet prefill (switch gdn_chunked; cuda/gdn.cu, metal/gdn.metal) -----------------------

constexpr int kGdnChunk = 64;         // tokens per chunk (L)
constexpr int kGdnChunkMinT = 16;     // below this many tokens the token-by-token scan runs
constexpr int kGdnChunkRows = 32;     // state rows per block / threadgroup of the chunk scan: DV must be a multiple
constexpr int kGdnChunkMaxCols = 256; // DV + DK: the columns of [V | K̂] the WY kernel solves for, one per thread

inline int gdn_chunks(int T) { return (T + kGdnChunk - 1) / kGdnChunk; }

// Whether gdn_scan runs the chunked form: the switch is on, T ≥ kGdnChunkMinT, and the shapes are ones its kernels
// take (DK 32, 64 or 128; DV a multiple of kGdnChunkRows with DV + DK ≤ kGdnChunkMaxCols). Otherwise the token-by-token
// scan runs, which is also the plain path of the switch.
inline bool gdn_chunked(const GdnArgs& a, const Optimisations& o) {
  return o.on(Opt::gdn_chunked) && a.T >= kGdnChunkMinT && (a.DK == 32 || a.DK == 64 || a.DK == 128) &&
         a.DV % kGdnChunkRows == 0 && a.DV + a.DK <= kGdnChunkMaxCols;
}

// ---- a decode token's Gated DeltaNet layer in one kernel (switches gdn_prep_fused, gdn_norm_fused, gdn_conv_fused) --

// What Backend::gdn_conv_scan_norm runs: the three ops apart (conv, scan, norm: the plain path), the conv and then one
// kernel for the recurrence and the gated norm, or one kernel for all three.
enum class GdnToken { apart, scan_norm, conv_scan_norm };

// The rule of both GPU backends: one token (T = 1) with gdn_prep_fused and gdn_norm_fused on runs the one-token kernel
// where the backend's kernel holds the shapes (`fits`), with the conv in it when gdn_conv_fused is on and the backend's
// conv fold takes them (`conv_fits`; Metal's alone: CUDA has no conv fold). The limits are each backend's own
// (cuda/gdn.cu, metal/gdn.metal).
inline GdnToken gdn_token_path(const GdnArgs& a, const Optimisations& o, bool fits, bool conv_fits) {
  if (a.T != 1 || !o.on(Opt::gdn_prep_fused) || !o.on(Opt::gdn_norm_fused) || !fits) return GdnToken::apart;
  return o.on(Opt::gdn_conv_fused) && conv_fits ? GdnToken::conv_scan_norm : GdnToken::scan_norm;
}

}  // namespace lily
