// norm.cpp: the launchers of metal/norm.metal (embedding lookup, RMSNorm, fused residual-add + RMSNorm; the header of
// the .metal file gives the math, mapping and costs). Each checks its preconditions, binds the args struct and the
// buffers in the kernel's parameter order, and dispatches.
#include <algorithm>
#include <cstdint>
#include <string>

#include "../../../metal/norm_args.h"
#include "backend/metal/ops.h"
#include "core/common.h"

namespace lily::metal {

namespace {

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

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

void check_norm(const char* name, int T, int H, const float* x, const float* w, const uint16_t* d,
                const uint16_t* out) {
  LILY_CHECK(T >= 0, name, ": T = ", T, " is negative");
  LILY_CHECK(H > 0 && H % 4 == 0 && H <= 8 * 4 * 32 * kNormMaxSimdgroups, name, ": H = ", H,
             " must be a positive multiple of 4 and at most ", 8 * 4 * 32 * int(kNormMaxSimdgroups));
  LILY_CHECK(aligned(x, 16) && aligned(w, 16) && aligned(d, 8) && aligned(out, 8), name,
             ": x and w must be 16-byte aligned, d and out 8-byte aligned");
}

}  // namespace

void embed(Encoder& enc, const QMatrix& table, const int32_t* tokens, int T, float* x) {
  LILY_CHECK(table.E == 1, "embed: the table must be a single matrix, got a stack of ", table.E);
  LILY_CHECK(T >= 0, "embed: T = ", T, " is negative");
  LILY_CHECK(table.bits == 4 || table.bits == 8, "embed: ", table.bits, "-bit tables are not supported (4 or 8)");
  const int per_word = 32 / table.bits;
  LILY_CHECK(table.group > 0 && table.group % per_word == 0 && table.K % table.group == 0, "embed: group ",
             table.group, " must divide K = ", table.K, " and be a multiple of ", per_word);
  LILY_CHECK(aligned(x, 16), "embed: x must be 16-byte aligned");
  if (T == 0) return;
  const int words = table.K / per_word;
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
