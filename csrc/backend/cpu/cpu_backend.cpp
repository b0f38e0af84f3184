// cpu_backend.cpp: the CPU backend. Host memory, fp32 activations, weights read in place from the mapped
// checkpoint (zero copy); each op forwards to its reference implementation in this folder.
#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <new>

#include "backend/allocations.h"
#include "backend/cpu/ops.h"

namespace lily {
namespace {

class CpuBackend final : public Backend {
 public:
  ~CpuBackend() override {
    for (void* p : mem_.live()) std::free(p);
  }
  std::string name() const override { return "cpu"; }
  size_t act_bytes() const override { return sizeof(float); }
  int default_prefill_chunk() const override { return 512; }  // benchmarks/NOTES.md, CPU backend

  void* alloc(size_t bytes) override {
    void* p = std::malloc(std::max<size_t>(bytes, 1));
    if (!p) throw std::bad_alloc();
    mem_.add(p, bytes);
    return p;
  }
  void release(void* p) override {
    if (!p) return;
    mem_.remove(p);
    std::free(p);
  }
  const void* weight(const void* host, size_t) override { return host; }
  // n may be 0 (an empty tensor), where the pointers may be null: memcpy/memset must not see them then.
  void to_device(void* dst, const void* src, size_t n) override { if (n) std::memcpy(dst, src, n); }
  void to_host(void* dst, const void* src, size_t n) override { if (n) std::memcpy(dst, src, n); }
  void copy(void* dst, const void* src, size_t n) override { if (n) std::memmove(dst, src, n); }
  void zero(void* dst, size_t n) override { if (n) std::memset(dst, 0, n); }
  void sync() override {}
  size_t bytes_in_use() const override { return mem_.in_use(); }
  size_t peak_bytes() const override { return mem_.peak(); }
  void reset_peak() override { mem_.reset_peak(); }

  void embed(const QMatrix& table, const int32_t* tokens, int T, float* x) override {
    cpu::embed(table, tokens, T, x);
  }
  void rms_norm(const float* x, const float* w, int T, int H, float eps, void* out) override {
    cpu::rms_norm(x, w, T, H, eps, f(out));
  }
  void add_rms_norm(float* x, const void* d, const float* w, int T, int H, float eps, void* out) override {
    cpu::add_rms_norm(x, cf(d), w, T, H, eps, f(out));
  }
  void qmm(const QMatrix& W, const void* x, int T, void* y, bool) override { cpu::qmm(W, cf(x), T, f(y)); }
  void attention(const AttnArgs& a, const void* qg, const void* k, const void* v, const float* q_norm,
                 const float* k_norm, void* k_cache, void* v_cache, void* out) override {
    cpu::attention(a, cf(qg), cf(k), cf(v), q_norm, k_norm, f(k_cache), f(v_cache), f(out));
  }
  void gdn_conv(const GdnArgs& a, const void* x, const float* w, void* conv_state, void* out) override {
    cpu::gdn_conv(a, cf(x), w, f(conv_state), f(out));
  }
  void gdn_scan(const GdnArgs& a, const void* c, const void* b, const void* alpha, const float* A_log,
                const float* dt_bias, float* state, void* y) override {
    cpu::gdn_scan(a, cf(c), cf(b), cf(alpha), A_log, dt_bias, state, f(y));
  }
  void gdn_norm(const GdnArgs& a, const void* y, const void* z, const float* w, void* out) override {
    cpu::gdn_norm(a, cf(y), cf(z), w, f(out));
  }
  void moe(const MoeArgs& a, const MoeWeights& w, const void* m, void* out) override {
    cpu::moe(a, w, cf(m), f(out));
  }

 private:
  static float* f(void* p) { return static_cast<float*>(p); }
  static const float* cf(const void* p) { return static_cast<const float*>(p); }

  Allocations mem_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace lily
