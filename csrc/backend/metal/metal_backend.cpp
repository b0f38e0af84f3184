// metal_backend.cpp: Backend on a unified-memory Metal Device. Shared by the Apple build and the CPU harness build.
#include "backend/metal/metal_backend.h"

#include <algorithm>
#include <cstring>

#include "backend/allocations.h"
#include "backend/metal/ops.h"
#include "backend/policy.h"
#include "core/common.h"

namespace lily::metal {
namespace {

class MetalBackend final : public Backend {
 public:
  explicit MetalBackend(std::unique_ptr<Device> dev) : dev_(std::move(dev)) {}
  ~MetalBackend() override {
    dev_->synchronize();
    for (void* p : mem_.live()) dev_->release(p);
  }

  std::string name() const override { return "metal"; }
  size_t act_bytes() const override { return 2; }
  int default_prefill_chunk() const override { return 512; }  // not yet measured on Apple hardware

  void* alloc(size_t bytes) override {
    void* p = dev_->alloc(std::max<size_t>(bytes, 16));
    mem_.add(p, bytes);
    return p;
  }
  void release(void* p) override {
    if (!p) return;
    dev_->synchronize();
    mem_.remove(p);
    dev_->release(p);
  }
  const void* weight(const void* host, size_t bytes) override { return dev_->weight(host, bytes); }
  void to_device(void* dst, const void* src, size_t n) override {
    dev_->synchronize();
    std::memcpy(dst, src, n);
  }
  void to_host(void* dst, const void* src, size_t n) override {
    dev_->synchronize();
    std::memcpy(dst, src, n);
  }
  void copy(void* dst, const void* src, size_t n) override {
    dev_->synchronize();
    std::memmove(dst, src, n);
  }
  void zero(void* dst, size_t n) override {
    dev_->synchronize();
    std::memset(dst, 0, n);
  }
  void sync() override { dev_->synchronize(); }
  size_t bytes_in_use() const override { return mem_.in_use(); }
  size_t peak_bytes() const override { return mem_.peak(); }
  void reset_peak() override { mem_.reset_peak(); }

  void embed(const QMatrix& table, const int32_t* tokens, int T, float* x) override {
    metal::embed(enc(), table, tokens, T, x);
  }
  void rms_norm(const float* x, const float* w, int T, int H, float eps, void* out) override {
    metal::rms_norm(enc(), x, w, T, H, eps, h(out));
  }
  void add_rms_norm(float* x, const void* d, const float* w, int T, int H, float eps, void* out) override {
    metal::add_rms_norm(enc(), x, ch(d), w, T, H, eps, h(out));
  }
  void qmm(const QMatrix& W, const void* x, int T, void* y, bool y_f32) override {
    metal::qmm(enc(), W, ch(x), T, y, y_f32);
  }
  void qmm_multi(const QMatrix* W, int n, const void* x, int T, void* const* y) override {
    metal::qmm_multi(enc(), W, n, ch(x), T, reinterpret_cast<uint16_t* const*>(y));
  }
  void attention(const AttnArgs& a, const void* qg, const void* k, const void* v, const float* q_norm,
                 const float* k_norm, void* k_cache, void* v_cache, void* out) override {
    metal::attention(enc(), optimisations(), a, ch(qg), ch(k), ch(v), q_norm, k_norm, h(k_cache), h(v_cache),
                     h(out));
  }
  void gdn_conv(const GdnArgs& a, const void* x, const float* w, void* conv_state, void* out) override {
    metal::gdn_conv(enc(), a, ch(x), w, h(conv_state), h(out));
  }
  void gdn_scan(const GdnArgs& a, const void* c, const void* b, const void* alpha, const float* A_log,
                const float* dt_bias, float* state, void* y) override {
    metal::gdn_scan(enc(), optimisations(), a, ch(c), ch(b), ch(alpha), A_log, dt_bias, state, h(y));
  }
  void gdn_norm(const GdnArgs& a, const void* y, const void* z, const float* w, void* out) override {
    metal::gdn_norm(enc(), a, ch(y), ch(z), w, h(out));
  }
  void gdn_conv_scan_norm(const GdnArgs& a, const void* x, const float* conv_w, void* conv_state, void* conv_out,
                          const void* b, const void* alpha, const float* A_log, const float* dt_bias, float* state,
                          const void* z, const float* w, void* out) override {
    if (!metal::gdn_conv_scan_norm(enc(), optimisations(), a, ch(x), conv_w, h(conv_state), h(conv_out), ch(b),
                                   ch(alpha), A_log, dt_bias, state, ch(z), w, h(out)))
      Backend::gdn_conv_scan_norm(a, x, conv_w, conv_state, conv_out, b, alpha, A_log, dt_bias, state, z, w, out);
  }
  void moe(const MoeArgs& a, const MoeWeights& w, const void* m, void* out) override {
    metal::moe(enc(), optimisations(), a, w, ch(m), h(out));
  }
  void moe_residual(float* x, const QMatrix& W_o, const void* y, const float* w, float eps, const MoeArgs& a,
                    const MoeWeights& mw, void* m, void* out) override {
    metal::moe_residual(enc(), optimisations(), x, W_o, ch(y), w, eps, a, mw, h(m), h(out));
  }
  bool can_sample(const SamplingParams& p, int n_valid) const override { return device_can_sample(p, n_valid); }
  void sample(const SamplingParams& p, int n_valid, const float* logits, const DeviceSampler& st) override {
    metal::sample(enc(), optimisations(), p, n_valid, logits, st);
  }
  // Unified memory: the result is read in place once the command buffer holding its step is done.
  void fetch_result(const int32_t* results, int slot) override {
    pending_[slot] = results + 2 * slot;
    tickets_[slot] = dev_->flush();
  }
  void wait_result(int slot, int32_t out[2]) override {
    dev_->wait(tickets_[slot]);
    out[0] = pending_[slot][0], out[1] = pending_[slot][1];
  }

 private:
  Encoder& enc() { return dev_->encoder(); }
  static uint16_t* h(void* p) { return static_cast<uint16_t*>(p); }
  static const uint16_t* ch(const void* p) { return static_cast<const uint16_t*>(p); }

  std::unique_ptr<Device> dev_;
  Allocations mem_;
  const int32_t* pending_[kResultSlots] = {};
  uint64_t tickets_[kResultSlots] = {};
};

}  // namespace

std::unique_ptr<Backend> make_backend(std::unique_ptr<Device> device) {
  return std::make_unique<MetalBackend>(std::move(device));
}

}  // namespace lily::metal
