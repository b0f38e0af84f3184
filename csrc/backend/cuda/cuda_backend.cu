// cuda_backend.cu: the CUDA backend. One stream; device memory from cudaMalloc (every allocation tracked and freed
// with the backend); weights copied to the device once at load; bf16 activations; each op forwards to its
// launcher in this folder (ops.cuh).
#include <algorithm>
#include <unordered_map>

#include "backend/allocations.h"
#include "backend/cuda/ops.cuh"

namespace lily {
namespace cuda {

void* Ctx::scratch(int slot, size_t bytes) {
  LILY_ASSERT(!side, "scratch slot ", slot, " requested on the side stream (take it before fork_side)");
  if (cap[slot] >= bytes) return buf[slot];
  LILY_ASSERT(!capturing, "scratch slot ", slot, " must grow to ", bytes, " bytes during graph capture");
  LILY_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (buf[slot]) LILY_CUDA_CHECK(cudaFree(buf[slot]));
  buf[slot] = nullptr;
  const size_t grown = std::max(bytes, cap[slot] + cap[slot] / 2);
  LILY_CUDA_CHECK(cudaMalloc(&buf[slot], grown));
  cap[slot] = grown;
  return buf[slot];
}

Ctx fork_side(const Ctx& ctx) {
  LILY_CUDA_CHECK(cudaEventRecord(ctx.side_fork, ctx.stream));
  LILY_CUDA_CHECK(cudaStreamWaitEvent(ctx.side_stream, ctx.side_fork, 0));
  Ctx s = ctx;
  s.stream = ctx.side_stream;
  s.side = true;
  return s;
}

void join_side(const Ctx& ctx) {
  LILY_CUDA_CHECK(cudaEventRecord(ctx.side_join, ctx.side_stream));
  LILY_CUDA_CHECK(cudaStreamWaitEvent(ctx.stream, ctx.side_join, 0));
}

namespace {

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    LILY_CHECK(e == cudaSuccess && n > 0, "CUDA backend: no CUDA device is available (",
               e == cudaSuccess ? "no devices" : cudaGetErrorString(e), ")");
    cudaDeviceProp prop;
    LILY_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    LILY_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_.stream, cudaStreamNonBlocking));
    LILY_CUDA_CHECK(cudaStreamCreateWithFlags(&ctx_.side_stream, cudaStreamNonBlocking));
    LILY_CUDA_CHECK(cudaEventCreateWithFlags(&ctx_.side_fork, cudaEventDisableTiming));
    LILY_CUDA_CHECK(cudaEventCreateWithFlags(&ctx_.side_join, cudaEventDisableTiming));
    ctx_.num_sms = prop.multiProcessorCount;
    ctx_.smem_optin = prop.sharedMemPerBlockOptin;
    ctx_.sm90a = prop.major == 9 && prop.minor == 0;
    device_ = prop.name;
    LILY_CUDA_CHECK(cudaMallocHost(&pinned_, sizeof(int32_t) * 2 * kResultSlots));
    LILY_CUDA_CHECK(cudaMalloc(&ctx_.moe_flags, sizeof(unsigned) * 2 * kQmvMaxT));
    LILY_CUDA_CHECK(cudaMemset(ctx_.moe_flags, 0, sizeof(unsigned) * 2 * kQmvMaxT));
    for (auto& e : result_events_) LILY_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(ctx_.stream);
    forget_replays();
    for (auto& e : result_events_) cudaEventDestroy(e);
    cudaFreeHost(pinned_);
    cudaFree(ctx_.moe_flags);
    for (void* p : mem_.live()) cudaFree(p);
    for (int s = 0; s < kNumSlots; ++s)
      if (ctx_.buf[s]) cudaFree(ctx_.buf[s]);
    cudaEventDestroy(ctx_.side_join);
    cudaEventDestroy(ctx_.side_fork);
    cudaStreamDestroy(ctx_.side_stream);
    cudaStreamDestroy(ctx_.stream);
  }

  std::string name() const override { return "cuda"; }
  std::string device() const override { return device_; }
  size_t act_bytes() const override { return 2; }
  int default_prefill_chunk() const override { return 8192; }  // benchmarks/NOTES.md, default chunk
  void set_optimisations(const Optimisations& o) override {
    Backend::set_optimisations(o);
    ctx_.opts = o;
  }

  void* alloc(size_t bytes) override {
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 16));
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw std::bad_alloc();
    }
    mem_.add(p, bytes);
    return p;
  }
  void release(void* p) override {
    if (!p) return;
    mem_.remove(p);
    LILY_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
    forget_replays();  // a recorded unit may point into the buffer
    LILY_CUDA_CHECK(cudaFree(p));
  }
  void release_state(void* p) override {  // no recorded unit reads snapshot memory: keep them
    if (!p) return;
    mem_.remove(p);
    if (cudaFree(p) != cudaSuccess) cudaGetLastError();  // at exit the runtime may be gone: nothing left to free
  }
  const void* weight(const void* host, size_t bytes) override {
    void* p = alloc(bytes);
    LILY_CUDA_CHECK(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    return p;
  }
  void to_device(void* dst, const void* src, size_t n) override {
    LILY_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, ctx_.stream));
    LILY_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));  // src may be pageable and short-lived
  }
  void to_host(void* dst, const void* src, size_t n) override {
    LILY_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, ctx_.stream));
    LILY_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream));
  }
  void copy(void* dst, const void* src, size_t n) override {
    LILY_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, ctx_.stream));
  }
  void zero(void* dst, size_t n) override { LILY_CUDA_CHECK(cudaMemsetAsync(dst, 0, n, ctx_.stream)); }
  void sync() override { LILY_CUDA_CHECK(cudaStreamSynchronize(ctx_.stream)); }
  size_t bytes_in_use() const override { return mem_.in_use() + scratch_bytes(); }
  size_t peak_bytes() const override { return mem_.peak() + scratch_bytes(); }
  void reset_peak() override { mem_.reset_peak(); }

  void embed(const QMatrix& table, const int32_t* tokens, int T, float* x) override {
    cuda::embed(ctx_, table, tokens, T, x);
  }
  void rms_norm(const float* x, const float* w, int T, int H, float eps, void* out) override {
    cuda::rms_norm(ctx_, x, w, T, H, eps, b(out));
  }
  void add_rms_norm(float* x, const void* d, const float* w, int T, int H, float eps, void* out) override {
    cuda::add_rms_norm(ctx_, x, cb(d), w, T, H, eps, b(out));
  }
  void qmm(const QMatrix& W, const void* x, int T, void* y, bool y_f32) override {
    cuda::qmm(ctx_, W, cb(x), T, y, y_f32);
  }
  void qmm_multi(const QMatrix* W, int n, const void* x, int T, void* const* y) override {
    bool same = cuda::qmv_takes(ctx_, W[0], T) && n <= 4;
    for (int i = 1; i < n; ++i) same = same && W[i].K == W[0].K && W[i].bits == W[0].bits && W[i].group == W[0].group;
    if (same)
      cuda::qmv_multi(ctx_, W, n, cb(x), T, y, false);
    else
      Backend::qmm_multi(W, n, x, T, y);
  }
  void moe_residual(float* x, const QMatrix& W_o, const void* y, const float* w, float eps, const MoeArgs& a,
                    const MoeWeights& mw, void* m, void* out) override {
    cuda::moe_residual(ctx_, x, W_o, cb(y), w, eps, a, mw, b(m), b(out));
  }
  void attention(const AttnArgs& a, const void* qg, const void* k, const void* v, const float* q_norm,
                 const float* k_norm, void* k_cache, void* v_cache, void* out) override {
    cuda::attention(ctx_, a, cb(qg), cb(k), cb(v), q_norm, k_norm, b(k_cache), b(v_cache), b(out));
  }
  void gdn_conv(const GdnArgs& a, const void* x, const float* w, void* conv_state, void* out) override {
    cuda::gdn_conv(ctx_, a, cb(x), w, b(conv_state), b(out));
  }
  void gdn_scan(const GdnArgs& a, const void* c, const void* bb, const void* alpha, const float* A_log,
                const float* dt_bias, float* state, void* y) override {
    cuda::gdn_scan(ctx_, a, cb(c), cb(bb), cb(alpha), A_log, dt_bias, state, b(y));
  }
  void gdn_norm(const GdnArgs& a, const void* y, const void* z, const float* w, void* out) override {
    cuda::gdn_norm(ctx_, a, cb(y), cb(z), w, b(out));
  }
  void gdn_conv_scan_norm(const GdnArgs& a, const void* x, const float* conv_w, void* conv_state, void* conv_out,
                          const void* bb, const void* alpha, const float* A_log, const float* dt_bias, float* state,
                          const void* z, const float* w, void* out) override {
    if (!cuda::gdn_conv_scan_norm(ctx_, a, cb(x), conv_w, b(conv_state), b(conv_out), cb(bb), cb(alpha), A_log,
                                  dt_bias, state, cb(z), w, b(out)))
      Backend::gdn_conv_scan_norm(a, x, conv_w, conv_state, conv_out, bb, alpha, A_log, dt_bias, state, z, w, out);
  }
  void moe(const MoeArgs& a, const MoeWeights& w, const void* m, void* out) override {
    cuda::moe(ctx_, a, w, cb(m), b(out));
  }

  bool can_sample(const SamplingParams& p, int n_valid) const override { return device_can_sample(p, n_valid); }
  void sample(const SamplingParams& p, int n_valid, const float* logits, const DeviceSampler& st) override {
    cuda::sample(ctx_, p, n_valid, logits, st);
  }

  // A unit runs eagerly the first time (so every scratch buffer reaches its size), is captured into a CUDA graph
  // the second time, and is replayed from then on.
  void replay(uint64_t key, const std::function<void()>& record) override {
    struct Pdl {  // PDL launches while the decode step is recorded or runs eagerly
      Ctx& c;
      explicit Pdl(Ctx& ctx) : c(ctx) { c.pdl = c.opts.on(Opt::pdl); }
      ~Pdl() { c.pdl = false; }
    } pdl(ctx_);
    auto it = graphs_.find(key);
    if (it == graphs_.end()) {
      graphs_[key] = nullptr;
      record();
      return;
    }
    if (!it->second) {
      cudaGraph_t g;
      ctx_.capturing = true;
      LILY_CUDA_CHECK(cudaStreamBeginCapture(ctx_.stream, cudaStreamCaptureModeThreadLocal));
      try {
        record();
      } catch (...) {
        cudaStreamEndCapture(ctx_.stream, &g);
        ctx_.capturing = false;
        throw;
      }
      LILY_CUDA_CHECK(cudaStreamEndCapture(ctx_.stream, &g));
      ctx_.capturing = false;
      LILY_CUDA_CHECK(cudaGraphInstantiate(&it->second, g, 0));
      LILY_CUDA_CHECK(cudaGraphDestroy(g));
    }
    LILY_CUDA_CHECK(cudaGraphLaunch(it->second, ctx_.stream));
  }
  void forget_replays() override {
    for (auto& kv : graphs_)
      if (kv.second) cudaGraphExecDestroy(kv.second);
    graphs_.clear();
  }
  void fetch_result(const int32_t* results, int slot) override {
    LILY_CUDA_CHECK(cudaMemcpyAsync(pinned_ + 2 * slot, results + 2 * slot, 8, cudaMemcpyDeviceToHost, ctx_.stream));
    LILY_CUDA_CHECK(cudaEventRecord(result_events_[slot], ctx_.stream));
  }
  void wait_result(int slot, int32_t out[2]) override {
    LILY_CUDA_CHECK(cudaEventSynchronize(result_events_[slot]));
    out[0] = pinned_[2 * slot], out[1] = pinned_[2 * slot + 1];
  }

 private:
  static bf16* b(void* p) { return static_cast<bf16*>(p); }
  static const bf16* cb(const void* p) { return static_cast<const bf16*>(p); }
  size_t scratch_bytes() const {
    size_t n = 0;
    for (int s = 0; s < kNumSlots; ++s) n += ctx_.cap[s];
    return n;
  }

  Ctx ctx_;
  std::string device_;
  std::unordered_map<uint64_t, cudaGraphExec_t> graphs_;
  int32_t* pinned_ = nullptr;  // [kResultSlots, 2] host side of the decode results
  cudaEvent_t result_events_[kResultSlots] = {};
  Allocations mem_;
};

}  // namespace
}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend() { return std::make_unique<cuda::CudaBackend>(); }

}  // namespace lily
