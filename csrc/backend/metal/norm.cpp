// norm.cpp: the launchers of metal/norm.metal (embedding lookup, RMSNorm, fused residual-add + RMSNorm; the header of
// the .metal file gives the math, mapping and costs). Each checks its preconditions, binds the args struct and the
// buffers in the kernel's parameter order, and dispatches.
#include <algorithm>
#include <cstdint>
#include <string>

#include "../../../metal/norm_args.h"
#include "backend/checks.h"
#include "backend/metal/ops.h"
#include "core/common.h"

namespace lily::metal {

namespace {

static_assert(8 * 4 * 32 * kNormMaxSimdgroups == kNormMaxH, "rows of up to 1024 threads × 8 float4 chunks");

// The instance (VPT float4 chunks per thread) and the threads (a multiple of 32) that cover a row of H values.
struct NormLaunch {
  std::string kernel;
  uint32_t threads;
};

NormLaunch plan_rms_norm(const char* name, int H) {
  const int H4 = H / 4;
  const int vpt = H4 <= kNormThreads ? 1 : H4 <= 2 * kNormThreads ? 2 : H4 <= 4 * kNormThreads ? 4 : 8;
  return {cat(name, "_c", vpt), uint32_t(ceil_div(ceil_div(H4, vpt), 32) * 32)};
}

}  // namespace

void embed(Encoder& enc, const QMatrix& table, const int32_t* tokens, int T, float* x) {
  check_embed(table, T, x);
  if (T == 0) return;
  const int words = table.K / (32 / table.bits);
  enc.kernel(table.bits == 4 ? "embed_q4" : "embed_q8");
  enc.set_args(EmbedKernelArgs{table.K, table.group});
  enc.set_buffer(1, table.w);       // w
  enc.set_buffer(2, table.scales);  // scales
  enc.set_buffer(3, table.biases);  // biases
  enc.set_buffer(4, tokens);        // tokens
  enc.set_buffer(5, x);             // x
  const uint32_t threads = uint32_t(std::min<int64_t>(kEmbedThreads, ceil_div(words, 32) * 32));
  enc.dispatch({uint32_t(T), 1, 1}, {threads, 1, 1});
}

void rms_norm(Encoder& enc, const float* x, const float* w, int T, int H, float eps, uint16_t* out) {
  check_norm("rms_norm", T, H, x, w, nullptr, out);
  if (T == 0) return;
  const NormLaunch l = plan_rms_norm("rms_norm", H);
  enc.kernel(l.kernel.c_str());
  enc.set_args(NormKernelArgs{H, eps});
  enc.set_buffer(1, x);    // x
  enc.set_buffer(2, w);    // w
  enc.set_buffer(3, out);  // out
  enc.dispatch({uint32_t(T), 1, 1}, {l.threads, 1, 1});
}

void add_rms_norm(Encoder& enc, float* x, const uint16_t* d, const float* w, int T, int H, float eps, uint16_t* out) {
  check_norm("add_rms_norm", T, H, x, w, d, out);
  if (T == 0) return;
  const NormLaunch l = plan_rms_norm("add_rms_norm", H);
  enc.kernel(l.kernel.c_str());
  enc.set_args(NormKernelArgs{H, eps});
  enc.set_buffer(1, x);    // x
  enc.set_buffer(2, d);    // d
  enc.set_buffer(3, w);    // w
  enc.set_buffer(4, out);  // out
  enc.dispatch({uint32_t(T), 1, 1}, {l.threads, 1, 1});
}

}  // namespace lily::metal
