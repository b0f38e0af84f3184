// scratch.h: the scratch memory of the GPU launchers, shared by CUDA (cuda/*.cu) and Metal (metal/*.cpp) so that
// the two backends cut their buffers the same way: one slot per buffer (buffers of different slots never alias within
// a forward pass), and the layout of every buffer whose parts several kernels of one op hand to each other. Each part
// starts on a 256-byte boundary; sizes are in bytes.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>

#include "backend/backend.h"
#include "backend/policy.h"

namespace lily {

// Scratch slots, one per buffer; an op file owns its slots.
enum Slot : int {
  kSlotMoeLogits, kSlotMoeRoute, kSlotMoeSort, kSlotMoeHidden, kSlotMoeOut, kSlotMoeShared,
  kSlotAttnQ, kSlotAttnPartial,
  kSlotGdn, kSlotGdnChunk,
  kSlotSample,
  kSlotNormParts,
  kNumSlots
};

inline size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// A buffer cut into N parts of the given sizes, each part starting on a 256-byte boundary.
template <size_t N>
struct Parts {
  std::array<size_t, N> offset{};
  size_t bytes = 0;  // the whole buffer: the last part's offset plus its size

  explicit Parts(const std::array<size_t, N>& sizes) {
    size_t o = 0;
    for (size_t i = 0; i < N; ++i) {
      offset[i] = o;
      o += align256(sizes[i]);
    }
    bytes = offset[N - 1] + sizes[N - 1];
  }
  template <typename T>
  T* at(void* base, size_t i) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset[i]);
  }
};

// ---- MoE (cuda/moe.cu, metal/moe.cpp) -----------------------------------------------------------------------------

// kSlotMoeRoute: per token the k expert ids i32[T, k], their weights ŵ f32[T, k], and γ f32[T].
struct MoeRoute {
  int32_t* ids;
  float* wts;
  float* gamma;
};
inline Parts<3> moe_route_parts(int T, int k) {
  return Parts<3>({size_t(T) * k * 4, size_t(T) * k * 4, size_t(T) * 4});
}
inline MoeRoute moe_route_at(void* base, const Parts<3>& p) {
  return {p.at<int32_t>(base, 0), p.at<float>(base, 1), p.at<float>(base, 2)};
}

// kSlotMoeSort: the expert-sorted order of the P = T·k (token, slot) pairs: offsets i32[E+1] (expert e owns sorted rows
// offsets[e] .. offsets[e+1]), rows i32[P] (the token of each sorted row), pos i32[P] (the sorted row of pair p), and
// for a sort that works in tiles of pairs the per-tile counts and bases i32[tiles, E] (tiles = 0: none).
struct MoeSort {
  int32_t* offsets;
  int32_t* rows;
  int32_t* pos;
  int32_t* tile_counts;
  int32_t* tile_base;
};
inline Parts<5> moe_sort_parts(int E, int P, int tiles) {
  const size_t pairs = size_t(P) * 4, per_tile = size_t(tiles) * E * 4;
  return Parts<5>({size_t(E + 1) * 4, pairs, pairs, per_tile, per_tile});
}
inline MoeSort moe_sort_at(void* base, const Parts<5>& p) {
  return {p.at<int32_t>(base, 0), p.at<int32_t>(base, 1), p.at<int32_t>(base, 2), p.at<int32_t>(base, 3),
          p.at<int32_t>(base, 4)};
}

// kSlotMoeShared: the shared expert of the prefill path: g, u f32[T, IS] (gate and up projections), h bf16[T, IS]
// (silu(g)·u) and s bf16[T, H] (its down projection). Part indices:
enum MoeSharedPart : int { kSharedG, kSharedU, kSharedH, kSharedS };
inline Parts<4> moe_shared_parts(int T, int IS, int H) {
  return Parts<4>({size_t(T) * IS * 4, size_t(T) * IS * 4, size_t(T) * IS * 2, size_t(T) * H * 2});
}

// ---- Gated DeltaNet scan (cuda/gdn.cu, metal/gdn.cpp) -------------------------------------------------------------

// kSlotGdn: what the scan's prep kernel hands on, for `rows` tokens per head (T, or T rounded up to whole chunks where
// the chunked form reads padding): q̂k̂ f32[NK, rows, 2·DK] (q̂ then k̂ of each token) and the gates float4[NV, rows]
// = (g, β, k̂·q̂, ln g).
inline Parts<2> gdn_scan_parts(const GdnArgs& a, int rows) {
  return Parts<2>({size_t(a.NK) * rows * 2 * a.DK * 4, size_t(a.NV) * rows * 16});
}

// kSlotGdnChunk: the WY form of each chunk (policy.h: gdn_chunked), nc = ⌈T/kGdnChunk⌉ chunks per value head, rows =
// NV·nc·kGdnChunk: W1 f32[NV, nc·L, DV], W2 f32[NV, nc·L, DK], P f32[NV, nc, L, L], λ f32[NV, nc·L] (L = kGdnChunk).
enum GdnChunkPart : int { kChunkW1, kChunkW2, kChunkP, kChunkLam };
inline Parts<4> gdn_chunk_parts(const GdnArgs& a) {
  const size_t rows = size_t(a.NV) * gdn_chunks(a.T) * kGdnChunk;
  return Parts<4>({rows * a.DV * 4, rows * a.DK * 4, rows * kGdnChunk * 4, rows * 4});
}

// ---- the folded norms (cuda/moe.cu, cuda/qmv.cu, switch norm_fold) -------------------------------------------------

// kSlotNormParts: what the output projection's GEMV, adding into one token's residual row x, leaves for the router's
// GEMV, which reads rms_norm(x)·w: `parts` fp32 partial sums of x² over blocks of x, and xw = x ⊙ w bf16 [H].
enum NormPart : int { kNormParts, kNormXw };
inline Parts<2> norm_parts(int parts, int H) { return Parts<2>({size_t(parts) * 4, size_t(H) * 2}); }

// ---- token selection (metal/sample.metal, switch sample_split) ----------------------------------------------------

// kSlotSample: what Metal's sample_part hands sample_merge for each of `parts` slices of the vocabulary: its partial
// (`partial` bytes: maxima, sum, argmax, candidate count), then room for `cand` candidates a slice: ids
// i32[parts, cand] and their processed logits f32[parts, cand]. Part indices:
enum SamplePart : int { kSampleParts, kSampleCandIds, kSampleCandX };
inline Parts<3> sample_parts(int parts, size_t partial, int cand) {
  const size_t per = size_t(parts) * cand * 4;
  return Parts<3>({size_t(parts) * partial, per, per});
}

}  // namespace lily
