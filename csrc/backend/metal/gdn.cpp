// gdn.cpp: the launchers of metal/gdn.metal (Gated DeltaNet conv, scan and gated RMSNorm; the header of the .metal
// file gives the math, mapping and costs). Each checks its preconditions, binds the args struct and the buffers in
// the kernel's parameter order, and dispatches.
#include <cstdint>

#include "../../../metal/gdn_args.h"
#include "backend/metal/ops.h"
#include "core/common.h"

namespace lily::metal {

namespace {

constexpr int kNormMaxDv = 32 * kGdnNormMaxPer;

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

GdnKernelArgs kernel_args(const GdnArgs& a, const char* name) {
  LILY_CHECK(a.T >= 0, name, ": T = ", a.T, " is negative");
  LILY_CHECK(a.NK > 0 && a.NV > 0 && a.NV % a.NK == 0, name, ": NV = ", a.NV, " must be a positive multiple of NK = ",
             a.NK);
  LILY_CHECK(a.DK > 0 && a.DV > 0, name, ": DK = ", a.DK, " and DV = ", a.DV, " must be positive");
  GdnKernelArgs k;
  k.T = a.T;
  k.NK = a.NK;
  k.NV = a.NV;
  k.DK = a.DK;
  k.DV = a.DV;
  k.C = 2 * a.NK * a.DK + a.NV * a.DV;
  k.K = a.conv_kernel;
  k.eps = a.eps;
  return k;
}

}  // namespace

void gdn_conv(Encoder& enc, const GdnArgs& a, const uint16_t* x, const float* w, uint16_t* conv_state, uint16_t* out) {
  const GdnKernelArgs k = kernel_args(a, "gdn_conv");
  LILY_CHECK(k.C % 4 == 0, "gdn_conv: conv_dim ", k.C, " must be a multiple of 4");
  LILY_CHECK(k.K >= 1 && k.K <= kGdnConvMaxK, "gdn_conv: conv_kernel ", k.K, " must be in [1, ", int(kGdnConvMaxK), "]");
  LILY_CHECK(aligned(x, 8) && aligned(out, 8) && aligned(conv_state, 8),
             "gdn_conv: x, out and conv_state must be 8-byte aligned");
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

void gdn_scan(Encoder& enc, const GdnArgs& a, const uint16_t* c, const uint16_t* b, const uint16_t* alpha,
              const float* A_log, const float* dt_bias, float* state, uint16_t* y) {
  const GdnKernelArgs k = kernel_args(a, "gdn_scan");
  const char* name = a.DK == 32 ? "gdn_scan_dk32" : a.DK == 64 ? "gdn_scan_dk64" : a.DK == 128 ? "gdn_scan_dk128"
                                                                                                 : nullptr;
  LILY_CHECK(name, "gdn_scan: DK = ", a.DK, " is not supported by the Metal backend (32, 64 or 128)");
  LILY_CHECK(a.DV % kGdnScanRows == 0, "gdn_scan: DV = ", a.DV, " must be a multiple of ", int(kGdnScanRows));
  if (a.T == 0) return;
  enc.kernel(name);
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
