// backend.h: the interface every backend implements. It is shaped around this model's own fused operations
// (architecture.md §2–§7), so a new backend adds kernels, never a new forward pass (model/forward.cpp owns that).
//
// Memory. Buffers are backend memory (`void*` device pointers; plain host memory on the CPU). Activations
// are stored in the backend's activation type (act_bytes(): 4 = fp32 on the CPU, 2 = bf16 on GPUs), except
// where an op says fp32: the residual stream x, the GDN recurrent state and the logits are always fp32. Small per-layer vectors
// (norm weights, conv taps, A_log, dt_bias) are converted to fp32 once at load.
//
// Letters follow architecture.md §1: T tokens in the call, H hidden, NH/NKV/HD attention heads, NK/NV/DK/DV
// Gated DeltaNet heads, E experts, I expert width.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/optimisations.h"
#include "core/sample.h"

namespace lily {

// A quantized matrix in MLX affine layout (architecture.md §9.3), or a stack of E of them (experts):
// W[e, n, k] = scales[e, n, k/group] · q[e, n, k] + biases[e, n, k/group], q packed LSB-first into u32 words.
struct QMatrix {
  const uint32_t* w = nullptr;       // [E, N, K·bits/32]
  const uint16_t* scales = nullptr;  // bf16 [E, N, K/group]
  const uint16_t* biases = nullptr;  // bf16 [E, N, K/group]
  int E = 1, N = 0, K = 0, bits = 4, group = 64;

  size_t words_per_row() const { return size_t(K) * bits / 32; }
  size_t groups_per_row() const { return size_t(K / group); }
  QMatrix expert(int e) const {  // one matrix of the stack
    QMatrix m = *this;
    m.E = 1;
    m.w += size_t(e) * N * words_per_row();
    m.scales += size_t(e) * N * groups_per_row();
    m.biases += size_t(e) * N * groups_per_row();
    return m;
  }
};

struct AttnArgs {
  int T;            // new tokens in this call
  int pos0;         // absolute position of the first one (= tokens already in the cache)
  int cache_cap;    // rows allocated in the K/V caches
  int NH, NKV, HD;  // heads, kv heads, head dim
  int rotary_dim;   // first rotary_dim dims of each head rotate (rotate-half pairing)
  float rope_theta;
  float eps;        // q/k RMSNorm epsilon
  // Device copy of the position, or null. When set, backends read the position from it and ignore pos0, so that a
  // recorded decode step (a CUDA graph) stays valid as the position advances.
  const int32_t* pos_dev = nullptr;
};

struct GdnArgs {
  int T;
  int NK, NV, DK, DV;  // key heads, value heads, key dim, value dim
  int conv_kernel;     // taps K (state holds K-1 rows)
  float eps;           // gated RMSNorm epsilon
};

struct MoeArgs {
  int T, H;
  int E, top_k, I, IS;  // experts, experts per token, expert width, shared-expert width
  bool norm_topk_prob;
};

struct MoeWeights {
  QMatrix router;             // [E, H] (8-bit in the release)
  QMatrix gate, up, down;     // experts: [E, I, H], [E, I, H], [E, H, I]
  QMatrix shared_gate, shared_up, shared_down;  // [IS, H], [IS, H], [H, IS]
  QMatrix shared_expert_gate;  // [1, H] (8-bit in the release)
};

// Device-resident state of one generation's token selection (backend memory), for backends that select tokens
// themselves so that a decode step needs no host round trip.
struct DeviceSampler {
  int32_t* counts = nullptr;  // [n_valid] times each id was generated (frequency / presence penalties)
  uint8_t* seen = nullptr;    // [n_valid] 1 if the id is in the prompt or was generated (repetition penalty)
  uint64_t* step = nullptr;   // tokens accepted so far (the counter of the draw)
  int32_t* token = nullptr;   // the chosen token is written here: the next decode step's input
  int32_t* results = nullptr; // [kResultSlots, 2]: token and logprob (float bits) of step s in slot s % kResultSlots
  int32_t* pos = nullptr;     // if set, the session's device position: advanced by one (the token just fed)
};
constexpr int kResultSlots = 4;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // The device it runs on, as the vendor names it ("NVIDIA H200"); the backend's name where there is none.
  virtual std::string device() const { return name(); }
  virtual size_t act_bytes() const = 0;
  // Tokens per forward call during prefill when the user sets none: the backend's measured best trade of speed
  // against working memory (benchmarks/NOTES.md).
  virtual int default_prefill_chunk() const = 0;

  // The ablation switches (core/optimisations.h); set once, before any op runs.
  virtual void set_optimisations(const Optimisations& o) { opts_ = o; }
  const Optimisations& optimisations() const { return opts_; }

  // ---- memory --------------------------------------------------------------------------------------------
  virtual void* alloc(size_t bytes) = 0;  // never returns null; throws std::bad_alloc
  virtual void release(void* p) = 0;
  // A weight tensor as the backend reads it: the host pointer itself where memory is shared (CPU, unified
  // memory; zero copy), else a resident copy owned by the backend.
  virtual const void* weight(const void* host, size_t bytes) = 0;
  // Memory for copies of state (snapshots) that no op and no recorded unit reads, filled and read with copy(),
  // to_host() and to_device(): released from any thread (under the model's backend lock) without waiting for or
  // dropping recorded units. Throws std::bad_alloc where there is no room.
  virtual void* alloc_state(size_t bytes) { return alloc(bytes); }
  virtual void release_state(void* p) { release(p); }
  virtual void to_device(void* dst, const void* src, size_t bytes) = 0;
  virtual void to_host(void* dst, const void* src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void zero(void* dst, size_t bytes) = 0;
  virtual void sync() = 0;
  virtual size_t bytes_in_use() const = 0;
  virtual size_t peak_bytes() const = 0;
  virtual void reset_peak() = 0;

  // ---- ops -----------------------------------------------------------------------------------------------
  // x[t] = dequant(table row tokens[t]) for t < T. tokens: device int32 [T]; x fp32 [T, H].
  virtual void embed(const QMatrix& table, const int32_t* tokens, int T, float* x) = 0;
  // out = x / sqrt(mean(x²) + eps) · w over rows of H. x fp32 [T, H]; out [T, H] activations; w fp32 [H].
  virtual void rms_norm(const float* x, const float* w, int T, int H, float eps, void* out) = 0;
  // x += d (the residual, fp32; d activations), then out = rms_norm(x). x is updated in place.
  virtual void add_rms_norm(float* x, const void* d, const float* w, int T, int H, float eps, void* out) = 0;
  // y = x · Wᵀ. x [T, K] activations; y [T, N], fp32 when y_f32 (logits) else activations.
  virtual void qmm(const QMatrix& W, const void* x, int T, void* y, bool y_f32) = 0;
  // y[i] = x · W[i]ᵀ for n matrices reading the same x (activations out); a backend may run them as one launch.
  virtual void qmm_multi(const QMatrix* W, int n, const void* x, int T, void* const* y) {
    for (int i = 0; i < n; ++i) qmm(W[i], x, T, y[i], false);
  }
  // a = rms_norm(x)·w (x fp32 [T, K], w fp32 [K]), then y[i] = a · W[i]ᵀ for n ≥ 1 matrices of one K; y_f32 (fp32
  // out) only with n = 1. a [T, K] activations is scratch: a backend that normalises x inside the GEMV need not write it.
  virtual void rms_norm_qmm(const float* x, const float* w, float eps, const QMatrix* W, int n, int T, void* a,
                            void* const* y, bool y_f32) {
    rms_norm(x, w, T, W[0].K, eps, a);
    if (n == 1)
      qmm(W[0], a, T, y[0], y_f32);
    else
      qmm_multi(W, n, a, T, y);
  }

  // Full attention (§4). qg [T, NH, 2·HD] (query then gate per head), k/v [T, NKV·HD]; q_norm/k_norm fp32 [HD].
  // Normalises and rotates q and k, appends k and v at rows pos0.. of the caches [cap, NKV, HD], runs causal
  // GQA attention over rows 0..pos0+t, and writes out[T, NH·HD] = attention ⊙ σ(gate).
  virtual void attention(const AttnArgs& a, const void* qg, const void* k, const void* v, const float* q_norm,
                         const float* k_norm, void* k_cache, void* v_cache, void* out) = 0;

  // Gated DeltaNet (§5), in three steps.
  // gdn_conv: causal depthwise conv over C = conv_dim channels with state [K-1, C] (raw inputs of the previous
  // tokens), then SiLU. x, out [T, C]; w fp32 [C, K]. The state is updated to the last K-1 raw rows.
  virtual void gdn_conv(const GdnArgs& a, const void* x, const float* w, void* conv_state, void* out) = 0;
  // gdn_scan: q, k = L2-normalised heads of c (q also scaled by DK^-1/2), β = σ(b), g = exp(−exp(A_log)·softplus(α+dt_bias)),
  // and the delta-rule recurrence on state fp32 [NV, DV, DK]. c [T, 2·NK·DK + NV·DV]; b, alpha [T, NV]; y [T, NV, DV].
  virtual void gdn_scan(const GdnArgs& a, const void* c, const void* b, const void* alpha, const float* A_log,
                        const float* dt_bias, float* state, void* y) = 0;
  // gdn_norm: out = rms_norm(y per head; w) · silu(z). y, z, out [T, NV·DV] (out may be y: in place); w fp32 [DV].
  virtual void gdn_norm(const GdnArgs& a, const void* y, const void* z, const float* w, void* out) = 0;
  // A Gated DeltaNet layer's conv, scan and gated norm: gdn_conv into conv_out [T, C] (scratch), gdn_scan into out
  // [T, NV·DV], gdn_norm in place. A backend that fuses them for a decode token need not write conv_out. out must not
  // alias x: a fused kernel reads x while other blocks write out.
  virtual void gdn_conv_scan_norm(const GdnArgs& a, const void* x, const float* conv_w, void* conv_state,
                                  void* conv_out, const void* b, const void* alpha, const float* A_log,
                                  const float* dt_bias, float* state, const void* z, const float* w, void* out) {
    gdn_conv(a, x, conv_w, conv_state, conv_out);
    gdn_scan(a, conv_out, b, alpha, A_log, dt_bias, state, out);
    gdn_norm(a, out, z, w, out);
  }

  // Sparse MoE block (§6): router softmax, top-k, renormalise, SwiGLU experts, shared expert with its sigmoid
  // gate. m, out [T, H].
  virtual void moe(const MoeArgs& a, const MoeWeights& w, const void* m, void* out) = 0;

  // The rest of a layer after its mixer: x += y·W_oᵀ (the mixer's output projection); m = rms_norm(x)·w; x += moe(m).
  // x fp32 [T, H]; y [T, W_o.K] activations (the mixer's output); m and out [T, H] activations are scratch. A backend
  // may add the projection and the MoE result into x in the kernels that compute them instead of through out, and
  // fold the norm into the router's product.
  virtual void moe_residual(float* x, const QMatrix& W_o, const void* y, const float* w, float eps, const MoeArgs& a,
                            const MoeWeights& mw, void* m, void* out) {
    qmm(W_o, y, a.T, out, false);
    add_rms_norm(x, out, w, a.T, a.H, eps, m);
    moe(a, mw, m, out);
    add_rms_norm(x, out, w, a.T, a.H, eps, m);  // x += moe(m); m, recomputed, is not used
  }

  // ---- decode without host round trips (optional) --------------------------------------------------------
  // True if sample() can select tokens on the device with these parameters (core/sample.h rules and draw).
  virtual bool can_sample(const SamplingParams& p, int n_valid) const { return false; }
  // Selects the next token from logits fp32 [V] (ids ≥ n_valid never), writes it to st.token and st.result,
  // records it in st.counts/st.seen and advances st.step. Enqueued like any op.
  virtual void sample(const SamplingParams& p, int n_valid, const float* logits, const DeviceSampler& st) {}
  // Runs `record` (a fixed sequence of ops whose buffers and shapes depend only on `key`) as one replayable unit
  // (a CUDA graph). The default runs it directly.
  virtual void replay(uint64_t key, const std::function<void()>& record) { record(); }
  // Drops every recorded unit (their buffers are about to change).
  virtual void forget_replays() {}
  // Enqueues the copy of results slot `slot` to the host; wait_result blocks until that copy has landed (work
  // enqueued after fetch_result may still be running) and returns {token, logprob bits}.
  virtual void fetch_result(const int32_t* results, int slot) { to_host(host_results_[slot], results + 2 * slot, 8); }
  virtual void wait_result(int slot, int32_t out[2]) { out[0] = host_results_[slot][0], out[1] = host_results_[slot][1]; }

 protected:
  int32_t host_results_[kResultSlots][2] = {};
  Optimisations opts_;
};

// Whether a backend can run here, found without creating it (registry.cpp).
struct BackendStatus {
  std::string name;
  bool compiled = false;  // built into this module
  bool usable = false;    // compiled, and its device answers
  std::string reason;     // why it cannot run here: not compiled, no device, driver too old …; empty when usable
  std::string device;     // what it runs on when usable ("NVIDIA H200", "Apple M2 Max", "x86_64, 16 threads")
};

// Every backend Lily has, compiled in or not, in the order a default choice tries them: cuda, metal, cpu.
std::vector<BackendStatus> backend_statuses();
// One backend's status; InputError for a name Lily does not have.
BackendStatus probe_backend(const std::string& name);
// The backend, created; InputError naming the reason when it is unknown, not compiled in or cannot run here.
std::unique_ptr<Backend> make_backend(const std::string& name);
std::vector<std::string> compiled_backends();

}  // namespace lily
