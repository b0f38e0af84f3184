// moe.cpp: the launcher of the MoE block (metal/moe.metal gives the math, mapping and costs; its GEMMs are qmm and
// moe_gemm of qmm.cpp). Router logits by qmm, then moe_route; T ≤ kQmvMaxT runs the two fused decode kernels (with
// the switch route_fused the routing is moe_gate_up's own, and there is no moe_route dispatch; route_logits makes its
// picks on the logits),
// larger T the prefill path: GPU-resident sort (moe_sort_scan with the switch moe_sort_scan, else moe_hist, moe_scan,
// moe_scatter), moe_gemm gate+up and down, the shared expert by qmm, and moe_combine. Scratch layouts and the checks
// the CUDA launcher shares come from backend/scratch.h and backend/checks.h. Nothing waits for the device.
#include <algorithm>
#include <array>
#include <cstdint>

#include "../../../metal/moe_args.h"
#include "backend/checks.h"
#include "backend/metal/ops.h"
#include "core/common.h"

namespace lily::metal {

namespace {

// Rows per threadgroup of the decode kernels.
constexpr int kDecodeRowsPerGroup = MOE_DECODE_SIMDGROUPS * MOE_DECODE_ROWS;

static_assert(MOE_MAX_EXPERTS == kMoeMaxExperts, "metal/moe_args.h and backend/checks.h disagree on E");

uint32_t cdiv(int64_t a, int64_t b) { return uint32_t((a + b - 1) / b); }

// Where the routing lands (backend/scratch.h): per token the k expert ids, their weights ŵ, and γ.
using Route = MoeRoute;

void bind_matrix(Encoder& enc, int first, const QMatrix& q) {
  enc.set_buffer(first, q.w);
  enc.set_buffer(first + 1, q.scales);
  enc.set_buffer(first + 2, q.biases);
}

// The kernel name for a bit width: "<stem>_q4" / "<stem>_q8" (or _s4 / _s8 for the routing kernel's w_seg).
const char* by_bits(int bits, const char* four, const char* eight) { return bits == 4 ? four : eight; }

bool decode_fits(const MoeArgs& a, const MoeWeights& w) {
  const int gb = w.gate.bits, db = w.down.bits;
  return a.T <= kQmvMaxT && w.up.bits == gb && w.shared_gate.bits == gb && w.shared_up.bits == gb &&
         w.shared_down.bits == db;
}

// logits: the router's, for the routing inside moe_gate_up (switch route_fused), or null after moe_route; pick_logits:
// switch route_logits, that routing's picks on the logits.
void moe_decode(Encoder& enc, const MoeArgs& a, const MoeWeights& w, const uint16_t* m, const Route& r,
                const float* logits, bool pick_logits, uint16_t* out) {
  MoeDecodeArgs d{};
  d.route_fused = logits ? 1 : 0;
  d.pick_logits = logits && pick_logits ? 1 : 0;
  d.E = a.E, d.norm_topk = a.norm_topk_prob ? 1 : 0;
  d.seg_bits = w.shared_expert_gate.bits, d.seg_group = w.shared_expert_gate.group;
  d.T = a.T, d.H = a.H, d.k = a.top_k, d.I = a.I, d.IS = a.IS, d.hs = std::max(a.I, a.IS);
  d.tiles = int(cdiv(d.hs, kDecodeRowsPerGroup));
  d.gate_group = w.gate.group, d.up_group = w.up.group, d.sgate_group = w.shared_gate.group;
  d.sup_group = w.shared_up.group, d.down_group = w.down.group, d.sdown_group = w.shared_down.group;
  float* h = static_cast<float*>(enc.scratch(kSlotMoeHidden, size_t(a.T) * (a.top_k + 1) * d.hs * sizeof(float)));
  const Size3 threads{MOE_DECODE_SIMDGROUPS * 32, 1, 1};

  enc.kernel(by_bits(w.gate.bits, "moe_gate_up_q4", "moe_gate_up_q8"));
  enc.set_args(d);
  enc.set_buffer(1, m);                   // m
  enc.set_buffer(2, r.ids);               // ids
  bind_matrix(enc, 3, w.gate);            // gate_w, gate_s, gate_b
  bind_matrix(enc, 6, w.up);              // up_w, up_s, up_b
  bind_matrix(enc, 9, w.shared_gate);     // sgate_w, sgate_s, sgate_b
  bind_matrix(enc, 12, w.shared_up);      // sup_w, sup_s, sup_b
  enc.set_buffer(15, h);                  // h
  enc.set_buffer(16, logits ? logits : r.wts);  // logits (read only under route_fused; every buffer bound)
  enc.set_buffer(17, r.wts);              // wts
  enc.set_buffer(18, r.gamma);            // gamma
  bind_matrix(enc, 19, w.shared_expert_gate);  // seg_w, seg_s, seg_b
  enc.dispatch({uint32_t((a.top_k + 1) * d.tiles), uint32_t(a.T), 1}, threads);

  enc.kernel(by_bits(w.down.bits, "moe_down_q4", "moe_down_q8"));
  enc.set_args(d);
  enc.set_buffer(1, h);                   // h
  enc.set_buffer(2, r.ids);               // ids
  enc.set_buffer(3, r.wts);               // wts
  enc.set_buffer(4, r.gamma);             // gamma
  bind_matrix(enc, 5, w.down);            // down_w, down_s, down_b
  bind_matrix(enc, 8, w.shared_down);     // sdown_w, sdown_s, sdown_b
  enc.set_buffer(11, out);                // out
  enc.dispatch({cdiv(a.H, kDecodeRowsPerGroup), uint32_t(a.T), 1}, threads);
}

// The expert-sorted order of the P = T·k pairs (backend/scratch.h: MoeSort): offsets[E+1], rows[P], pos[P].
MoeSort sort_pairs(Encoder& enc, const Optimisations& opts, const MoeArgs& a, const Route& r) {
  MoeSortArgs sa{};
  sa.P = a.T * a.top_k, sa.k = a.top_k, sa.E = a.E;
  const bool scan = opts.on(Opt::moe_sort_scan);
  sa.tiles = scan ? 0 : int(cdiv(sa.P, MOE_SORT_TILE));  // the tiled sort's per-tile counts and bases
  const Parts<5> sp = moe_sort_parts(a.E, sa.P, sa.tiles);
  const MoeSort s = moe_sort_at(enc.scratch(kSlotMoeSort, sp.bytes), sp);

  if (scan) {
    enc.kernel("moe_sort_scan");
    enc.set_args(sa);
    enc.set_buffer(1, r.ids);      // ids
    enc.set_buffer(2, s.offsets);  // offsets
    enc.set_buffer(3, s.rows);     // rows
    enc.set_buffer(4, s.pos);      // pos
    enc.dispatch({1, 1, 1}, {MOE_SORT_SCAN_THREADS, 1, 1});
    return s;
  }

  enc.kernel("moe_hist");
  enc.set_args(sa);
  enc.set_buffer(1, r.ids);          // ids
  enc.set_buffer(2, s.tile_counts);  // tile_counts
  enc.dispatch({uint32_t(sa.tiles), 1, 1}, {MOE_SORT_TILE, 1, 1});

  enc.kernel("moe_scan");
  enc.set_args(sa);
  enc.set_buffer(1, s.tile_counts);  // tile_counts
  enc.set_buffer(2, s.tile_base);    // tile_base
  enc.set_buffer(3, s.offsets);      // offsets
  enc.dispatch({1, 1, 1}, {MOE_MAX_EXPERTS, 1, 1});

  enc.kernel("moe_scatter");
  enc.set_args(sa);
  enc.set_buffer(1, r.ids);        // ids
  enc.set_buffer(2, s.tile_base);  // tile_base
  enc.set_buffer(3, s.offsets);    // offsets
  enc.set_buffer(4, s.rows);       // rows
  enc.set_buffer(5, s.pos);        // pos
  enc.dispatch({uint32_t(sa.tiles), 1, 1}, {MOE_SORT_TILE, 1, 1});
  return s;
}

void moe_prefill(Encoder& enc, const Optimisations& opts, const MoeArgs& a, const MoeWeights& w, const uint16_t* m,
                 const Route& r, uint16_t* out) {
  const int T = a.T, k = a.top_k, H = a.H, IS = a.IS, P = T * k;
  const MoeSort sort = sort_pairs(enc, opts, a, r);
  const int32_t *offsets = sort.offsets, *rows = sort.rows, *pos = sort.pos;

  // Routed experts on the sorted rows: h = silu(m·W_gateᵀ) ⊙ (m·W_upᵀ), then yd = h·W_downᵀ.
  uint16_t* h = static_cast<uint16_t*>(enc.scratch(kSlotMoeHidden, size_t(P) * a.I * sizeof(uint16_t)));
  uint16_t* yd = static_cast<uint16_t*>(enc.scratch(kSlotMoeOut, size_t(P) * H * sizeof(uint16_t)));
  moe_gemm(enc, w.gate, &w.up, offsets, rows, P, m, h);
  moe_gemm(enc, w.down, nullptr, offsets, nullptr, P, h, yd);

  // Shared expert: g, u f32 by qmm, sh = silu(g)·u (bf16), s = sh·W_sdᵀ.
  const Parts<4> shp = moe_shared_parts(T, IS, H);
  void* shb = enc.scratch(kSlotMoeShared, shp.bytes);
  float* sg = shp.at<float>(shb, kSharedG);
  float* su = shp.at<float>(shb, kSharedU);
  uint16_t* sh = shp.at<uint16_t>(shb, kSharedH);
  uint16_t* s = shp.at<uint16_t>(shb, kSharedS);
  qmm(enc, w.shared_gate, m, T, sg, true);
  qmm(enc, w.shared_up, m, T, su, true);
  const MoeSwigluArgs swa{T * IS};
  enc.kernel("moe_swiglu");
  enc.set_args(swa);
  enc.set_buffer(1, sg);  // g
  enc.set_buffer(2, su);  // u
  enc.set_buffer(3, sh);  // h
  enc.dispatch({cdiv(swa.n, MOE_ELEMENT_THREADS), 1, 1}, {MOE_ELEMENT_THREADS, 1, 1});
  qmm(enc, w.shared_down, sh, T, s, false);

  const MoeCombineArgs ca{T, H, k};
  enc.kernel("moe_combine");
  enc.set_args(ca);
  enc.set_buffer(1, yd);       // yd
  enc.set_buffer(2, s);        // s
  enc.set_buffer(3, pos);      // pos
  enc.set_buffer(4, r.wts);    // wts
  enc.set_buffer(5, r.gamma);  // gamma
  enc.set_buffer(6, out);      // out
  enc.dispatch({cdiv(H, MOE_ELEMENT_THREADS), uint32_t(T), 1}, {MOE_ELEMENT_THREADS, 1, 1});
}

// Switch norm_fold: m = rms_norm(x)·nw is not computed yet; the router folds the norm in from xw = x ⊙ nw and the
// partial sums of x² (qmv_residual's) and writes m.
struct Fold {
  const float* x;
  const float* nw;
  const uint16_t* xw;
  const float* parts;
  int nparts;
  float eps;
  uint16_t* m;
};

void check_moe_args(const MoeArgs& a, const MoeWeights& w, const uint16_t* m, const uint16_t* out) {
  const std::array<MoeMatrix, 8> matrices = check_moe(a, w, m, out);  // backend/checks.h; then these kernels' rules
  LILY_CHECK(a.I % 8 == 0 && a.IS % 8 == 0, "moe: I = ", a.I, " and IS = ", a.IS, " must be multiples of 8");
  for (const MoeMatrix& mm : matrices) {
    LILY_CHECK(mm.q.group > 0 && mm.q.group % 8 == 0 && mm.K % mm.q.group == 0, "moe: ", mm.name, " has group=",
               mm.q.group, ", which must divide K=", mm.K, " and be a multiple of 8");
    LILY_CHECK(uint64_t(mm.E) * mm.N * mm.q.words_per_row() < (uint64_t(1) << 32), "moe: ", mm.name,
               " has too many codes for 32-bit indices");
  }
  LILY_CHECK(int64_t(a.T) * (a.top_k + 1) * std::max({a.H, a.I, a.IS, a.E}) < (int64_t(1) << 31),
             "moe: T·(top_k+1)·max(H, I, IS, E) must stay below 2^31");
}

// The MoE block on m into out; fold: m from the router (above).
void run_moe(Encoder& enc, const Optimisations& opts, const MoeArgs& a, const MoeWeights& w, const uint16_t* m,
             uint16_t* out, const Fold* fold) {
  float* logits = static_cast<float*>(enc.scratch(kSlotMoeLogits, size_t(a.T) * a.E * sizeof(float)));
  const Parts<3> rp = moe_route_parts(a.T, a.top_k);
  const Route r = moe_route_at(enc.scratch(kSlotMoeRoute, rp.bytes), rp);

  if (fold)
    qmv_fold(enc, w.router, fold->xw, fold->parts, fold->nparts, fold->eps, fold->x, fold->nw, logits, true, fold->m);
  else
    qmm(enc, w.router, m, a.T, logits, true);  // ℓ = m·W_routerᵀ (f32)
  const bool decode = decode_fits(a, w);
  if (decode && opts.on(Opt::route_fused)) {  // the routing runs inside moe_gate_up
    moe_decode(enc, a, w, m, r, logits, opts.on(Opt::route_logits), out);
    return;
  }
  const MoeRouteArgs ra{a.T, a.E, a.top_k, a.H, w.shared_expert_gate.group, a.norm_topk_prob ? 1 : 0};
  enc.kernel(by_bits(w.shared_expert_gate.bits, "moe_route_s4", "moe_route_s8"));
  enc.set_args(ra);
  enc.set_buffer(1, logits);                     // logits
  enc.set_buffer(2, m);                          // m
  bind_matrix(enc, 3, w.shared_expert_gate);     // seg_w, seg_s, seg_b
  enc.set_buffer(6, r.ids);                      // ids
  enc.set_buffer(7, r.wts);                      // wts
  enc.set_buffer(8, r.gamma);                    // gamma
  enc.dispatch({cdiv(a.T, MOE_ROUTE_TOKENS), 1, 1}, {MOE_ROUTE_TOKENS * 32, 1, 1});

  if (decode)
    moe_decode(enc, a, w, m, r, nullptr, false, out);
  else
    moe_prefill(enc, opts, a, w, m, r, out);
}

}  // namespace

void moe(Encoder& enc, const Optimisations& opts, const MoeArgs& a, const MoeWeights& w, const uint16_t* m,
         uint16_t* out) {
  check_moe_args(a, w, m, out);
  if (a.T == 0) return;
  run_moe(enc, opts, a, w, m, out, nullptr);
}

void moe_residual(Encoder& enc, const Optimisations& opts, float* x, const QMatrix& W_o, const uint16_t* y,
                  const float* nw, float eps, const MoeArgs& a, const MoeWeights& w, uint16_t* m, uint16_t* out) {
  check_moe_args(a, w, m, out);
  LILY_CHECK(W_o.N == a.H, "moe_residual: the output projection has ", W_o.N, " rows, not H=", a.H);
  if (a.T == 0) return;
  if (a.T == 1 && opts.on(Opt::norm_fold)) {
    const int n = qmv_residual_parts(W_o);
    const Parts<2> np = norm_parts(n, a.H);
    void* buf = enc.scratch(kSlotNormParts, np.bytes);
    float* parts = np.at<float>(buf, kNormParts);
    uint16_t* xw = np.at<uint16_t>(buf, kNormXw);
    qmv_residual(enc, W_o, y, x, nw, xw, parts);  // x ← x + y·W_oᵀ, with x ⊙ nw and Σx² by threadgroup
    const Fold fold{x, nw, xw, parts, n, eps, m};
    run_moe(enc, opts, a, w, m, out, &fold);  // m by the router
  } else {
    qmm(enc, W_o, y, a.T, out, false);              // d = y·W_oᵀ
    add_rms_norm(enc, x, out, nw, a.T, a.H, eps, m);  // x ← x + d;  m = rms_norm(x)·nw
    run_moe(enc, opts, a, w, m, out, nullptr);
  }
  add_rms_norm(enc, x, out, nw, a.T, a.H, eps, m);  // x ← x + moe(m); m, recomputed, is not used
}

}  // namespace lily::metal
