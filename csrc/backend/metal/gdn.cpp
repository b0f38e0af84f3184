// gdn.cpp: the launchers of metal/gdn.metal (Gated DeltaNet conv, scan and gated RMSNorm; the header of the .metal
// file gives the math, mapping and costs). Each checks its preconditions (backend/checks.h, then its kernels' own),
// binds the args struct and the buffers in the kernel's parameter order, and dispatches. gdn_scan runs the chunked
// prefill when backend/policy.h's gdn_chunked says so (the rule the CUDA backend follows), else the token-by-token
// scan; gdn_conv_scan_norm runs a decode token's layer in one dispatch when gdn_token_path says so.
#include <algorithm>
#include <cstdint>

#include "../../../metal/gdn_args.h"
#include "backend/checks.h"
#include "backend/metal/ops.h"
#include "backend/policy.h"
#include "backend/scratch.h"
#include "core/common.h"
#include "core/config.h"

namespace lily::metal {

namespace {

constexpr int kNormMaxDv = 32 * kGdnNormMaxPer;
static_assert(kGdnConvMaxK == kMaxConvKernel, "the conv window holds the config's largest kernel (core/config.h)");
static_assert(kGdnChunkL == kGdnChunk && kGdnCsRows == kGdnChunkRows && kGdnWyThreads == kGdnChunkMaxCols,
              "metal/gdn_args.h and backend/policy.h disagree on the chunked prefill");

// The args of every kernel of the file (the chunked prefill's Tp and nc too); T, heads and dims checked first.
GdnKernelArgs kernel_args(const GdnArgs& a, const char* name) {
  check_gdn_heads(a, name);
  GdnKernelArgs k{};
  k.T = a.T;
  k.NK = a.NK;
  k.NV = a.NV;
  k.DK = a.DK;
  k.DV = a.DV;
  k.C = 2 * a.NK * a.DK + a.NV * a.DV;
  k.K = a.conv_kernel;
  k.eps = a.eps;
  k.nc = gdn_chunks(a.T);
  k.Tp = k.nc * kGdnChunkL;
  return k;
}

// The key dims the scan kernels are instantiated for (by_dk picks the instance).
void check_dk(const GdnArgs& a, const char* op) {
  LILY_CHECK(a.DK == 32 || a.DK == 64 || a.DK == 128, op, ": DK = ", a.DK,
             " is not supported by the Metal backend (32, 64 or 128)");
}

const char* by_dk(int DK, const char* dk32, const char* dk64, const char* dk128) {
  return DK == 32 ? dk32 : DK == 64 ? dk64 : dk128;
}

// The chunked prefill (backend/policy.h: gdn_chunked): prep (q̂, k̂, gates for Tp tokens) → WY form of every chunk →
// the scan over chunks. Scratch: kSlotGdn (q̂k̂, gates) and kSlotGdnChunk (W1, W2, P, λ), laid out by backend/scratch.h.
void gdn_scan_chunked(Encoder& enc, const GdnArgs& a, const GdnKernelArgs& k, const uint16_t* c, const uint16_t* b,
                      const uint16_t* alpha, const float* A_log, const float* dt_bias, float* state, uint16_t* y) {
  LILY_CHECK(int64_t(k.Tp) * std::max({k.C, 2 * a.NK * a.DK, a.NV * std::max({a.DV, a.DK, int(kGdnChunkL)})}) <
                 (int64_t(1) << 31),
             "gdn_scan: T = ", a.T, " is too large for the 32-bit indices of the chunked prefill");
  const Parts<2> sp = gdn_scan_parts(a, k.Tp);
  void* prep = enc.scratch(kSlotGdn, sp.bytes);
  float* qk = sp.at<float>(prep, 0);
  float* gates = sp.at<float>(prep, 1);  // float4 [NV, Tp]
  const Parts<4> cp = gdn_chunk_parts(a);
  void* wy = enc.scratch(kSlotGdnChunk, cp.bytes);
  float* W1 = cp.at<float>(wy, kChunkW1);
  float* W2 = cp.at<float>(wy, kChunkW2);
  float* P = cp.at<float>(wy, kChunkP);
  float* lam = cp.at<float>(wy, kChunkLam);

  enc.kernel(by_dk(a.DK, "gdn_chunk_prep_dk32", "gdn_chunk_prep_dk64", "gdn_chunk_prep_dk128"));
  enc.set_args(k);
  enc.set_buffer(1, c);        // c
  enc.set_buffer(2, b);        // b
  enc.set_buffer(3, alpha);    // alpha
  enc.set_buffer(4, A_log);    // A_log
  enc.set_buffer(5, dt_bias);  // dt_bias
  enc.set_buffer(6, qk);       // qk
  enc.set_buffer(7, gates);    // gates
  enc.dispatch({uint32_t(ceil_div(int64_t(k.Tp) * a.NK, kGdnPrepSgs)), 1, 1}, {32 * kGdnPrepSgs, 1, 1});

  enc.kernel(by_dk(a.DK, "gdn_wy_dk32", "gdn_wy_dk64", "gdn_wy_dk128"));
  enc.set_args(k);
  enc.set_buffer(1, qk);     // qk
  enc.set_buffer(2, gates);  // gates
  enc.set_buffer(3, c);      // c
  enc.set_buffer(4, W1);     // W1
  enc.set_buffer(5, W2);     // W2
  enc.set_buffer(6, P);      // P
  enc.set_buffer(7, lam);    // lam
  enc.dispatch({uint32_t(k.nc), uint32_t(a.NV), 1}, {kGdnWyThreads, 1, 1});

  enc.kernel(by_dk(a.DK, "gdn_chunk_scan_dk32", "gdn_chunk_scan_dk64", "gdn_chunk_scan_dk128"));
  enc.set_args(k);
  enc.set_buffer(1, qk);     // qk
  enc.set_buffer(2, W1);     // W1
  enc.set_buffer(3, W2);     // W2
  enc.set_buffer(4, P);      // P
  enc.set_buffer(5, lam);    // lam
  enc.set_buffer(6, state);  // state
  enc.set_buffer(7, y);      // y
  enc.dispatch({uint32_t(a.NV), uint32_t(a.DV / kGdnCsRows), 1}, {kGdnCsThreads, 1, 1});
}

}  // namespace

void gdn_conv(Encoder& enc, const GdnArgs& a, const uint16_t* x, const float* w, uint16_t* conv_state, uint16_t* out) {
  check_gdn_conv(a, x, conv_state, out);
  const GdnKernelArgs k = kernel_args(a, "gdn_conv");
  if (a.T == 0) return;
  enc.kernel("gdn_conv");
  enc.set_args(k);
  enc.set_buffer(1, x);           // x
  enc.set_buffer(2, w);           // w
  enc.set_buffer(3, conv_state);  // conv_state
  enc.set_buffer(4, out);         // out
  const Size3 groups{uint32_t(ceil_div(k.C / 4, kGdnConvThreads)), uint32_t(ceil_div(a.T, kGdnConvChunk)), 1};
  enc.dispatch(groups, {uint32_t(kGdnConvThreads), 1, 1});
}

void gdn_scan(Encoder& enc, const Optimisations& opts, const GdnArgs& a, const uint16_t* c, const uint16_t* b,
              const uint16_t* alpha, const float* A_log, const float* dt_bias, float* state, uint16_t* y) {
  const GdnKernelArgs k = kernel_args(a, "gdn_scan");
  check_dk(a, "gdn_scan");
  LILY_CHECK(a.DV % kGdnScanRows == 0, "gdn_scan: DV = ", a.DV, " must be a multiple of ", int(kGdnScanRows));
  if (a.T == 0) return;
  if (gdn_chunked(a, opts)) {
    gdn_scan_chunked(enc, a, k, c, b, alpha, A_log, dt_bias, state, y);
    return;
  }
  enc.kernel(by_dk(a.DK, "gdn_scan_dk32", "gdn_scan_dk64", "gdn_scan_dk128"));
  enc.set_args(k);
  enc.set_buffer(1, c);        // c
  enc.set_buffer(2, b);        // b
  enc.set_buffer(3, alpha);    // alpha
  enc.set_buffer(4, A_log);    // A_log
  enc.set_buffer(5, dt_bias);  // dt_bias
  enc.set_buffer(6, state);    // state
  enc.set_buffer(7, y);        // y
  enc.dispatch({uint32_t(a.NV), uint32_t(a.DV / kGdnScanRows), 1}, {uint32_t(kGdnScanThreads), 1, 1});
}

bool gdn_conv_scan_norm(Encoder& enc, const Optimisations& opts, const GdnArgs& a, const uint16_t* x,
                        const float* conv_w, uint16_t* conv_state, uint16_t* conv_out, const uint16_t* b,
                        const uint16_t* alpha, const float* A_log, const float* dt_bias, float* state,
                        const uint16_t* z, const float* w, uint16_t* out) {
  // The one-token kernel takes DV rows per threadgroup, or R·DV with the conv, at most kGdnTokMaxRows.
  const int R = a.NK > 0 ? a.NV / a.NK : 0;
  const GdnToken path = gdn_token_path(a, opts, a.DV % kGdnTokRowsPerSg == 0 && a.DV <= kGdnTokMaxRows,
                                       int64_t(R) * a.DV <= kGdnTokMaxRows);
  if (path == GdnToken::apart) return false;
  const GdnKernelArgs k = kernel_args(a, "gdn_conv_scan_norm");
  check_dk(a, "gdn_conv_scan_norm");
  LILY_CHECK(z && w && out, "gdn_conv_scan_norm: null z, w or out");
  const bool conv = path == GdnToken::conv_scan_norm;
  if (conv) {
    check_gdn_conv(a, x, conv_state, out);
  } else {
    gdn_conv(enc, a, x, conv_w, conv_state, conv_out);
  }
  enc.kernel(conv ? by_dk(a.DK, "gdn_conv_token_dk32", "gdn_conv_token_dk64", "gdn_conv_token_dk128")
                  : by_dk(a.DK, "gdn_token_dk32", "gdn_token_dk64", "gdn_token_dk128"));
  enc.set_args(k);
  enc.set_buffer(1, conv ? x : conv_out);  // in
  enc.set_buffer(2, conv_w);               // conv_w
  enc.set_buffer(3, conv_state);           // conv_state
  enc.set_buffer(4, b);                    // b
  enc.set_buffer(5, alpha);                // alpha
  enc.set_buffer(6, A_log);                // A_log
  enc.set_buffer(7, dt_bias);              // dt_bias
  enc.set_buffer(8, state);                // state
  enc.set_buffer(9, z);                    // z
  enc.set_buffer(10, w);                   // norm_w
  enc.set_buffer(11, out);                 // out
  const int blocks = (conv ? R : 1) * a.DV / kGdnTokRowsPerSg;  // of kGdnTokRowsPerSg rows, one per simdgroup and pass
  enc.dispatch({uint32_t(conv ? a.NK : a.NV), 1, 1}, {uint32_t(32 * std::min<int>(blocks, kGdnTokSgs)), 1, 1});
  return true;
}

void gdn_norm(Encoder& enc, const GdnArgs& a, const uint16_t* y, const uint16_t* z, const float* w, uint16_t* out) {
  const GdnKernelArgs k = kernel_args(a, "gdn_norm");
  LILY_CHECK(a.DV <= kNormMaxDv, "gdn_norm: DV = ", a.DV, " must be at most ", kNormMaxDv);
  if (a.T == 0) return;
  enc.kernel("gdn_norm");
  enc.set_args(k);
  enc.set_buffer(1, y);    // y
  enc.set_buffer(2, z);    // z
  enc.set_buffer(3, w);    // w
  enc.set_buffer(4, out);  // out
  enc.dispatch({uint32_t(ceil_div(int64_t(a.T) * a.NV, kGdnNormSgs)), 1, 1}, {uint32_t(32 * kGdnNormSgs), 1, 1});
}

}  // namespace lily::metal
