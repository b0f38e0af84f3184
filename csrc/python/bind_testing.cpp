// bind_testing.cpp: lily._core.testing — run one Backend op on numpy inputs, on any compiled backend. The op test
// (tests/ops) feeds identical inputs to the CPU reference and to each GPU backend through run_op; the op
// benchmark (benchmarks/bench_ops.py) times the same launches with time_op.
//
// Inputs are float32 arrays for activations (converted to the backend's activation type on upload: bf16 on
// GPUs), float32 for fp32 tensors, uint32/uint16 for quantized triplets (`<name>.w`, `<name>.scales`,
// `<name>.biases`) and int32 for token ids. Outputs come back as float32 arrays. The op "sample" (a device token
// selection, Backend::sample; tests/metal/test_metal_sample.py) takes the DeviceSampler state as int32 counts, uint8
// seen and uint64 step, and returns it with the results slots as float32 words holding their bytes.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "core/common.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace lily;

#ifdef LILY_STEP_TRACE
#include <nanobind/stl/vector.h>

#include "backend/cuda/step_trace.h"
#endif
#ifdef LILY_HAS_METAL_EMU
namespace lily {
std::map<std::string, uint64_t> metal_emu_dispatches();  // tests/metal/harness/emu_device.cpp
}
#endif

namespace {

using Array = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu>;

// One backend per (name, disabled optimisations): params["disable"] ("a,b") runs an op with those switches off.
Backend& backend(const std::string& name, const nb::dict& params) {
  static std::map<std::string, std::unique_ptr<Backend>> cache;
  std::vector<std::string> off;
  if (params.contains("disable")) {
    std::string list = nb::cast<std::string>(params["disable"]);
    for (size_t at = 0; at <= list.size();) {
      const size_t end = std::min(list.find(',', at), list.size());
      off.push_back(list.substr(at, end - at));
      at = end + 1;
    }
  }
  const Optimisations opts = Optimisations::with_disabled(off);
  auto& b = cache[name + "/" + opts.disabled_names()];
  if (!b) {
    b = make_backend(name);
    b->set_optimisations(opts);
  }
  return *b;
}

class Runner {
 public:
  Runner(Backend& be, const nb::dict& params, const nb::dict& inputs) : be_(be), params_(params), inputs_(inputs) {}
  ~Runner() {
    for (void* p : bufs_) be_.release(p);
  }

  int i(const char* k) const { return nb::cast<int>(params_[k]); }
  float f(const char* k) const { return nb::cast<float>(params_[k]); }
  uint64_t u64(const char* k) const { return nb::cast<uint64_t>(params_[k]); }
  bool flag(const char* k) const { return params_.contains(k) && nb::cast<bool>(params_[k]); }

  Array input(const std::string& k) const {
    LILY_CHECK(inputs_.contains(k.c_str()), "run_op: missing input '", k, "'");
    return nb::cast<Array>(inputs_[k.c_str()]);
  }
  // An activation tensor (f32 in, backend activation type on the device).
  void* act(const std::string& k) {
    Array a = input(k);
    LILY_CHECK(a.dtype() == nb::dtype<float>(), "run_op: input '", k, "' must be float32");
    return track(k, upload_act(static_cast<const float*>(a.data()), a.size()), a, true);
  }
  float* f32(const std::string& k) {
    Array a = input(k);
    LILY_CHECK(a.dtype() == nb::dtype<float>(), "run_op: input '", k, "' must be float32");
    return static_cast<float*>(track(k, upload(a.data(), a.size() * 4), a, false));
  }
  void* raw(const std::string& k) {
    Array a = input(k);
    return upload(a.data(), a.nbytes());
  }
  void* raw_value(int32_t v) { return upload(&v, sizeof v); }
  // An input of any dtype that the op updates in place: it comes back as float32 words holding its bytes (view them
  // as the input's dtype; the last word is padded).
  void* raw_inout(const std::string& k) {
    Array a = input(k);
    const size_t words = (a.nbytes() + 3) / 4;
    void* p = alloc(words * 4);
    be_.to_device(p, a.data(), a.nbytes());
    outs_[k] = {p, words, true};
    return p;
  }
  // Working memory of n bytes the op may use (not returned).
  void* scratch(size_t n) { return alloc(n); }
  QMatrix q(const std::string& k, int E) {
    Array w = input(k + ".w"), s = input(k + ".scales");
    LILY_CHECK(w.ndim() >= 2 && s.ndim() >= 2, "run_op: ", k, ".w and ", k, ".scales must have a row dimension");
    QMatrix m;
    m.E = E > 0 ? E : 1;
    m.N = int(w.shape(w.ndim() - 2));
    m.K = nb::cast<int>(params_[(k + ".K").c_str()]);
    const size_t words = w.shape(w.ndim() - 1), groups = s.shape(s.ndim() - 1);
    LILY_CHECK(m.K > 0 && groups > 0 && m.K % groups == 0 && words * 32 % m.K == 0, "run_op: ", k, " has K=", m.K,
               ", ", words, " words and ", groups, " scales per row: no whole group size (K / scales) and bit width ",
               "(32·words / K)");
    m.bits = int(32 * words / m.K);
    m.group = int(m.K / groups);
    m.w = static_cast<const uint32_t*>(raw(k + ".w"));
    m.scales = static_cast<const uint16_t*>(raw(k + ".scales"));
    m.biases = static_cast<const uint16_t*>(raw(k + ".biases"));
    return m;
  }
  // A new output buffer of n elements (activations unless f32).
  void* out(const std::string& k, size_t n, bool is_f32) {
    void* p = alloc(n * (is_f32 ? 4 : be_.act_bytes()));
    outs_[k] = {p, n, is_f32 || be_.act_bytes() == 4};
    return p;
  }
  nb::dict results() {
    be_.sync();
    nb::dict d;
    for (auto& [k, o] : outs_) {
      std::vector<float> host(o.n);
      if (o.is_f32) {
        be_.to_host(host.data(), o.ptr, o.n * 4);
      } else {
        std::vector<uint16_t> bits(o.n);
        be_.to_host(bits.data(), o.ptr, o.n * 2);
        for (size_t j = 0; j < o.n; ++j) host[j] = bf16_to_f32(bits[j]);
      }
      float* data = new float[o.n];
      std::memcpy(data, host.data(), o.n * 4);
      nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
      size_t shape[1] = {o.n};
      d[k.c_str()] = nb::ndarray<nb::numpy, float>(data, 1, shape, owner);
    }
    return d;
  }

 private:
  struct Out {
    void* ptr;
    size_t n;
    bool is_f32;
  };
  void* alloc(size_t n) {
    bufs_.push_back(be_.alloc(n));
    return bufs_.back();
  }
  void* upload(const void* host, size_t n) {
    void* p = alloc(n);
    be_.to_device(p, host, n);
    return p;
  }
  void* upload_act(const float* x, size_t n) {
    if (be_.act_bytes() == 4) return upload(x, n * 4);
    std::vector<uint16_t> bits(n);
    for (size_t j = 0; j < n; ++j) bits[j] = f32_to_bf16(x[j]);
    return upload(bits.data(), n * 2);
  }
  // Inputs that ops update in place are also returned.
  void* track(const std::string& k, void* p, const Array& a, bool is_act) {
    outs_[k] = {p, a.size(), !is_act || be_.act_bytes() == 4};
    return p;
  }

  Backend& be_;
  nb::dict params_, inputs_;
  std::vector<void*> bufs_;
  std::map<std::string, Out> outs_;
};

// Binds one op's buffers and returns the launch.
std::function<void()> prepare(Backend& be, Runner& r, const std::string& op) {
  if (op == "embed") {
    int T = r.i("T");
    QMatrix tab = r.q("table", 0);
    auto* tok = static_cast<const int32_t*>(r.raw("tokens"));
    auto* x = static_cast<float*>(r.out("x", size_t(T) * tab.K, true));
    return [&be, tab, tok, T, x] { be.embed(tab, tok, T, x); };
  }
  if (op == "rms_norm") {
    int T = r.i("T"), H = r.i("H");
    float eps = r.f("eps");
    float* x = r.f32("x");
    float* w = r.f32("w");
    void* out = r.out("out", size_t(T) * H, false);
    return [&be, x, w, T, H, eps, out] { be.rms_norm(x, w, T, H, eps, out); };
  }
  if (op == "add_rms_norm") {
    int T = r.i("T"), H = r.i("H");
    float eps = r.f("eps");
    float* x = r.f32("x");
    void* d = r.act("d");
    float* w = r.f32("w");
    void* out = r.out("out", size_t(T) * H, false);
    return [&be, x, d, w, T, H, eps, out] { be.add_rms_norm(x, d, w, T, H, eps, out); };
  }
  if (op == "qmm") {
    int T = r.i("T");
    bool y_f32 = r.flag("y_f32");
    QMatrix W = r.q("W", 0);
    void* x = r.act("x");
    void* y = r.out("y", size_t(T) * W.N, y_f32);
    return [&be, W, x, T, y, y_f32] { be.qmm(W, x, T, y, y_f32); };
  }
  if (op == "qmm_multi") {  // matrices W0.. W{n-1} reading the same x
    const int T = r.i("T"), n = r.i("n");
    std::vector<QMatrix> Ws;
    std::vector<void*> ys;
    for (int i = 0; i < n; ++i) Ws.push_back(r.q(cat("W", i), 0));
    void* x = r.act("x");
    for (int i = 0; i < n; ++i) ys.push_back(r.out(cat("y", i), size_t(T) * Ws[i].N, false));
    return [&be, Ws, ys, x, T, n] { be.qmm_multi(Ws.data(), n, x, T, ys.data()); };
  }
  if (op == "rms_norm_qmm") {  // y_i = (rms_norm(x)·w) · W_iᵀ for W0.. W{n-1}; y_f32 only with n = 1
    const int T = r.i("T"), n = r.i("n");
    const bool y_f32 = r.flag("y_f32");
    std::vector<QMatrix> Ws;
    std::vector<void*> ys;
    for (int i = 0; i < n; ++i) Ws.push_back(r.q(cat("W", i), 0));
    float* x = r.f32("x");
    float* w = r.f32("w");
    const float eps = r.f("eps");
    void* a = r.scratch(size_t(T) * Ws[0].K * be.act_bytes());
    for (int i = 0; i < n; ++i) ys.push_back(r.out(cat("y", i), size_t(T) * Ws[i].N, y_f32));
    return [&be, Ws, ys, x, w, eps, a, T, n, y_f32] { be.rms_norm_qmm(x, w, eps, Ws.data(), n, T, a, ys.data(), y_f32); };
  }
  if (op == "attention") {
    AttnArgs a{r.i("T"), r.i("pos0"), r.i("cache_cap"), r.i("NH"), r.i("NKV"), r.i("HD"), r.i("rotary_dim"),
               r.f("rope_theta"), r.f("eps")};
    if (r.flag("device_pos")) {  // a replayed decode step: the position lives on the device, the host's is stale
      a.pos_dev = static_cast<const int32_t*>(r.raw_value(a.pos0));
      a.pos0 = 0;
    }
    void *qg = r.act("qg"), *k = r.act("k"), *v = r.act("v");
    float *qn = r.f32("q_norm"), *kn = r.f32("k_norm");
    void *kc = r.act("k_cache"), *vc = r.act("v_cache");
    void* out = r.out("out", size_t(a.T) * a.NH * a.HD, false);
    return [&be, a, qg, k, v, qn, kn, kc, vc, out] { be.attention(a, qg, k, v, qn, kn, kc, vc, out); };
  }
  if (op == "sample") {  // one device token selection (Backend::sample) at step `step`, without a session position
    SamplingParams p;
    p.temperature = r.f("temperature"), p.top_k = r.i("top_k"), p.top_p = r.f("top_p"), p.min_p = r.f("min_p");
    p.repetition_penalty = r.f("repetition_penalty"), p.presence_penalty = r.f("presence_penalty");
    p.frequency_penalty = r.f("frequency_penalty");
    p.seed = r.u64("seed");
    const int n_valid = r.i("n_valid");
    LILY_CHECK(be.can_sample(p, n_valid), "run_op sample: the ", be.name(), " backend cannot select with these "
               "parameters on the device");
    const float* logits = r.f32("logits");
    DeviceSampler st;  // counts i32[n_valid], seen u8[n_valid], step u64[1] in and out; results i32[kResultSlots, 2]
    st.counts = static_cast<int32_t*>(r.raw_inout("counts"));
    st.seen = static_cast<uint8_t*>(r.raw_inout("seen"));
    st.step = static_cast<uint64_t*>(r.raw_inout("step"));
    st.token = static_cast<int32_t*>(r.out("token", 1, true));
    st.results = static_cast<int32_t*>(r.out("results", 2 * kResultSlots, true));
    return [&be, p, n_valid, logits, st] { be.sample(p, n_valid, logits, st); };
  }
  GdnArgs g{r.i("T"), 0, 0, 0, 0, 4, 0.0f};
  auto gdn_dims = [&] {
    g.NK = r.i("NK"), g.NV = r.i("NV"), g.DK = r.i("DK"), g.DV = r.i("DV");
    g.conv_kernel = r.i("conv_kernel");
    g.eps = r.f("eps");
  };
  if (op == "gdn_conv") {
    gdn_dims();
    const size_t C = 2 * size_t(g.NK) * g.DK + size_t(g.NV) * g.DV;
    void* x = r.act("x");
    float* w = r.f32("w");
    void* state = r.act("conv_state");
    void* out = r.out("out", size_t(g.T) * C, false);
    return [&be, g, x, w, state, out] { be.gdn_conv(g, x, w, state, out); };
  }
  if (op == "gdn_scan") {
    gdn_dims();
    void *c = r.act("c"), *b = r.act("b"), *al = r.act("alpha");
    float *A = r.f32("A_log"), *dt = r.f32("dt_bias"), *state = r.f32("state");
    void* y = r.out("y", size_t(g.T) * g.NV * g.DV, false);
    return [&be, g, c, b, al, A, dt, state, y] { be.gdn_scan(g, c, b, al, A, dt, state, y); };
  }
  if (op == "gdn_conv_scan_norm") {  // gdn_conv, gdn_scan, gdn_norm; the conv output is scratch
    gdn_dims();
    const size_t C = 2 * size_t(g.NK) * g.DK + size_t(g.NV) * g.DV;
    void *x = r.act("x"), *cst = r.act("conv_state"), *b = r.act("b"), *al = r.act("alpha"), *z = r.act("z");
    float *cw = r.f32("conv_w"), *A = r.f32("A_log"), *dt = r.f32("dt_bias"), *state = r.f32("state");
    float* w = r.f32("w");
    void* conv_out = r.scratch(size_t(g.T) * C * be.act_bytes());
    void* out = r.out("out", size_t(g.T) * g.NV * g.DV, false);
    return [&be, g, x, cw, cst, conv_out, b, al, A, dt, state, z, w, out] {
      be.gdn_conv_scan_norm(g, x, cw, cst, conv_out, b, al, A, dt, state, z, w, out);
    };
  }
  if (op == "gdn_norm") {
    gdn_dims();
    void *y = r.act("y"), *z = r.act("z");
    float* w = r.f32("w");
    void* out = r.out("out", size_t(g.T) * g.NV * g.DV, false);
    return [&be, g, y, z, w, out] { be.gdn_norm(g, y, z, w, out); };
  }
  if (op == "moe" || op == "moe_residual") {
    MoeArgs a{r.i("T"), r.i("H"), r.i("E"), r.i("top_k"), r.i("I"), r.i("IS"), r.flag("norm_topk_prob")};
    MoeWeights w;
    w.router = r.q("router", 0);
    w.gate = r.q("gate", a.E);
    w.up = r.q("up", a.E);
    w.down = r.q("down", a.E);
    w.shared_gate = r.q("shared_gate", 0);
    w.shared_up = r.q("shared_up", 0);
    w.shared_down = r.q("shared_down", 0);
    w.shared_expert_gate = r.q("shared_expert_gate", 0);
    if (op == "moe_residual") {  // x += y·W_oᵀ; x += MoE(rms_norm(x)·w): x comes back updated
      const QMatrix o = r.q("o", 0);
      float* x = r.f32("x");
      void* y = r.act("y");
      float* nw = r.f32("w");
      const float eps = r.f("eps");
      void* m = r.scratch(size_t(a.T) * a.H * be.act_bytes());
      void* out = r.scratch(size_t(a.T) * a.H * be.act_bytes());
      return [&be, a, w, o, x, y, nw, eps, m, out] { be.moe_residual(x, o, y, nw, eps, a, w, m, out); };
    }
    void* m = r.act("m");
    void* out = r.out("out", size_t(a.T) * a.H, false);
    return [&be, a, w, m, out] { be.moe(a, w, m, out); };
  }
  throw InputError(cat("run_op: unknown op '", op, "'"));
}

}  // namespace

void init_testing(nb::module_& m) {
  nb::module_ t = m.def_submodule("testing", "Run and time single backend ops (op tests and op benchmarks).");
  t.def("run_op",
        [](const std::string& backend_name, const std::string& op, const nb::dict& params, const nb::dict& inputs) {
          Backend& be = backend(backend_name, params);
          Runner r(be, params, inputs);
          auto launch = prepare(be, r, op);
          {
            nb::gil_scoped_release release;
            launch();
          }
          return r.results();
        },
        "backend"_a, "op"_a, "params"_a, "inputs"_a,
        "Runs one op; returns its outputs (and inputs it updates in place) as float32 arrays.");
#ifdef LILY_HAS_METAL_EMU
  t.def("metal_kernels", &metal_emu_dispatches,
        "Every kernel of metal/*.metal in this harness build, with the number of times it has been dispatched.");
#endif
#ifdef LILY_STEP_TRACE
  t.def("step_trace_start", &step_trace_start, "capacity"_a = size_t(1) << 20,
        "Starts the decode-step probe (a LILY_STEP_TRACE build): every kernel's block 0 records when it passes its "
        "PDL wait, every block when it reaches its pdl_trigger (launch id's top bit set), the kernels that mark phases "
        "(LILY_TRACE_PHASE, TracePhases) record them, and the kernels of graphs captured meanwhile are named.");
  t.def("step_trace_stop", [] {
        StepTrace r = step_trace_stop();
        return nb::make_tuple(r.names, r.grids, r.times);
      },
      "Stops the probe: (kernel names of the captured graphs in launch order, launch ids, times in ns).");
#endif
  t.def("time_op",
        [](const std::string& backend_name, const std::string& op, const nb::dict& params, const nb::dict& inputs,
           int iters) {
          Backend& be = backend(backend_name, params);
          Runner r(be, params, inputs);
          auto launch = prepare(be, r, op);
          nb::gil_scoped_release release;
          launch();  // warm-up
          be.sync();
          auto t0 = std::chrono::steady_clock::now();
          for (int k = 0; k < iters; ++k) launch();
          be.sync();
          std::chrono::duration<double, std::micro> dt = std::chrono::steady_clock::now() - t0;
          return dt.count() / iters;
        },
        "backend"_a, "op"_a, "params"_a, "inputs"_a, "iters"_a = 20,
        "Mean microseconds per launch over `iters` back-to-back launches (after one warm-up).");
}
