// bind_model.cpp: lily._core.Model / Session / Snapshot / Generator. The GIL is released around every call that
// computes. The Model holds a reference to every array its weights point into (the arrays themselves, not the dict
// they came in), so nothing done to the dict or the checkpoint frees memory the core reads.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <climits>
#include <memory>
#include <optional>

#include "core/common.h"
#include "core/mapped_files.h"
#include "core/parallel.h"
#include "model/generator.h"
#include "model/model.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace lily;

namespace {

using Tokens = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using HostArray = nb::ndarray<nb::ro, nb::device::cpu>;

// The registrations of a model's mapped files with the SIGBUS handler (core/mapped_files.h).
class MappedFiles {
 public:
  MappedFiles() = default;
  MappedFiles(MappedFiles&& o) noexcept : ids_(std::move(o.ids_)) { o.ids_.clear(); }
  MappedFiles& operator=(MappedFiles&&) = delete;
  ~MappedFiles() { clear(); }
  void clear() {
    for (int id : ids_) remove_mapped_file(id);
    ids_.clear();
  }
  void add(const void* begin, size_t bytes, const std::string& path) {
    ids_.push_back(add_mapped_file(begin, bytes, path));
  }

 private:
  std::vector<int> ids_;
};

// A Model plus the Python arrays it reads (destroyed last) and its mapped files' registrations.
struct PyModel {
  std::vector<HostArray> arrays;
  MappedFiles mapped;
  std::unique_ptr<Model> model;
};

// A config field into the core's type. Integers must fit an int (the core's sizes); the message names the field
// and the limit.
template <typename T>
void set_field(const nb::dict& d, const char* key, T& field, bool required) {
  if (!d.contains(key)) {
    LILY_CHECK(!required, "config.json: missing required field text_config.", key);
    return;
  }
  nb::object v = d[key];
  const std::string where = cat("config.json: field text_config.", key);
  if constexpr (std::is_same_v<T, int>) {
    if (!PyLong_Check(v.ptr()) || PyBool_Check(v.ptr())) throw InputError(where + " must be an integer");
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    LILY_CHECK(!overflow && x >= INT_MIN && x <= INT_MAX, where,
               overflow ? std::string(" is out of range") : cat(" = ", x, " is out of range"), " (the limit is ",
               INT_MAX, ")");
    field = int(x);
  } else {
    try {
      field = nb::cast<T>(v);
    } catch (const nb::cast_error&) {
      throw InputError(where + " has the wrong type");
    }
  }
}

Config config_from_dict(const nb::dict& d) {
  Config c;
#define REQ(f) set_field(d, #f, c.f, true)
#define OPT(f) set_field(d, #f, c.f, false)
  REQ(hidden_size); REQ(num_hidden_layers); REQ(num_attention_heads); REQ(num_key_value_heads); REQ(head_dim);
  REQ(linear_num_key_heads); REQ(linear_num_value_heads); REQ(linear_key_head_dim); REQ(linear_value_head_dim);
  REQ(num_experts); REQ(num_experts_per_tok); REQ(moe_intermediate_size); REQ(shared_expert_intermediate_size);
  REQ(vocab_size);
  OPT(full_attention_interval); OPT(linear_conv_kernel_dim); OPT(max_position_embeddings); OPT(rope_theta);
  OPT(partial_rotary_factor); OPT(rms_norm_eps); OPT(tie_word_embeddings); OPT(norm_topk_prob);
#undef REQ
#undef OPT
  return c;
}

nb::dict config_to_dict(const Config& c) {
  nb::dict d;
#define F(f) d[#f] = c.f
  F(hidden_size); F(num_hidden_layers); F(full_attention_interval); F(num_attention_heads); F(num_key_value_heads);
  F(head_dim); F(linear_num_key_heads); F(linear_num_value_heads); F(linear_key_head_dim); F(linear_value_head_dim);
  F(linear_conv_kernel_dim); F(num_experts); F(num_experts_per_tok); F(moe_intermediate_size);
  F(shared_expert_intermediate_size); F(vocab_size); F(max_position_embeddings); F(rope_theta);
  F(partial_rotary_factor); F(rms_norm_eps); F(tie_word_embeddings); F(norm_topk_prob);
#undef F
  return d;
}

const char* dtype_name(const HostArray& a) {
  nb::dlpack::dtype t = a.dtype();
  if (t == nb::dtype<uint32_t>()) return "U32";
  if (t == nb::dtype<uint16_t>()) return "BF16";  // numpy has no bfloat16: the loader hands bf16 bits as uint16
  if (t == nb::dtype<float>()) return "F32";
  if (t.code == uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return "F16";
  return "other";
}

void make_model(PyModel* self, const nb::dict& config, const nb::dict& tensors, const nb::dict& sources,
                const std::string& backend, const nb::dict& mapped_files, const std::vector<std::string>& disable) {
  std::vector<HostArray> arrays;
  MappedFiles mapped;
  TensorMap map;
  for (auto [k, v] : tensors) {
    if (!nb::isinstance<nb::str>(k)) throw InputError("tensors: every key must be a tensor name (a string)");
    std::string name = nb::cast<std::string>(k);
    HostArray a;
    if (!nb::try_cast(v, a)) throw InputError(cat("tensor '", name, "': not an array"));
    arrays.push_back(a);  // the array itself (or the converted copy nanobind made): what t.data points into
    HostTensor t;
    t.data = a.data();
    t.nbytes = a.nbytes();
    t.dtype = dtype_name(a);
    for (size_t i = 0; i < a.ndim(); ++i) t.shape.push_back(int64_t(a.shape(i)));
    int64_t stride = 1;
    for (size_t i = a.ndim(); i-- > 0;) {
      LILY_CHECK(a.shape(i) == 1 || a.stride(i) == stride, "tensor '", name, "': not contiguous");
      stride *= int64_t(a.shape(i));
    }
    if (sources.contains(k)) t.source = nb::cast<std::string>(sources[k]);
    map.emplace(std::move(name), std::move(t));
  }
  for (auto [k, v] : mapped_files) {
    HostArray a;
    if (!nb::isinstance<nb::str>(k) || !nb::try_cast(v, a) || a.ndim() != 1 || a.dtype() != nb::dtype<uint8_t>())
      throw InputError("mapped_files: must map file names to uint8 views of their whole mappings");
    arrays.push_back(a);
    mapped.add(a.data(), a.nbytes(), nb::cast<std::string>(k));
  }
  Config c = config_from_dict(config);
  const Optimisations opts = Optimisations::with_disabled(disable);
  std::unique_ptr<Model> model;
  {
    nb::gil_scoped_release release;
    model = std::make_unique<Model>(c, map, backend, opts);
  }
  if (!model->weights().reads_host) {  // the backend copied every weight: the arrays are no longer read
    mapped.clear();
    arrays.clear();
  }
  new (self) PyModel{std::move(arrays), std::move(mapped), std::move(model)};
}

// The length of a token array, refused unless it fits an int and (room_in: the session) the session's context, so
// that nothing is allocated for a call that cannot run.
int token_count(const Tokens& tokens, const Session* room_in = nullptr) {
  LILY_CHECK(tokens.shape(0) <= size_t(INT_MAX), "too many tokens: ", tokens.shape(0));
  const int n = int(tokens.shape(0));
  if (room_in) room_in->check_room(n);
  return n;
}

using Progress = std::optional<nb::callable>;

unsigned long main_thread_id = 0;  // Python's main thread: the only one that runs signal handlers

// The hook of a prefill called from Python (model.h, ChunkHook). Between chunks, with the GIL held, it runs the
// pending signal handlers, so that Ctrl-C raises KeyboardInterrupt there rather than after the whole prefill, then
// the progress callback with (done, total). An exception from either stops the prefill and leaves the call; the
// session holds the chunks done. The callback is borrowed: the caller's argument outlives the call. Off the main
// thread and without a callback there is nothing to do between chunks: no hook (no GIL taken, no device sync).
ChunkHook python_hook(const Progress& progress) {
  PyObject* callback = progress ? progress->ptr() : nullptr;
  if (!callback && PyThread_get_thread_ident() != main_thread_id) return nullptr;
  return [callback](int done, int total) {
    nb::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw nb::python_error();
    if (callback) nb::handle{callback}(done, total);
  };
}

nb::ndarray<nb::numpy, float> new_array(std::vector<size_t> shape) {
  size_t n = 1;
  for (size_t s : shape) n *= s;
  float* data = new float[n];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return nb::ndarray<nb::numpy, float>(data, shape.size(), shape.data(), owner);
}

}  // namespace

void init_model(nb::module_& m) {
  main_thread_id = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const InputError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  nb::exception<SessionConflict>(m, "SessionConflictError", PyExc_RuntimeError)
      .attr("__doc__") = "A session used by two threads at once, or a generation continued on a session that "
                         "something else changed since its last step.";

  m.def("backends",
        [] {
          std::vector<BackendStatus> statuses;
          {
            nb::gil_scoped_release release;  // a probe may start a GPU driver
            statuses = backend_statuses();
          }
          nb::list out;
          for (const BackendStatus& b : statuses) {
            nb::dict d;
            d["name"] = b.name;
            d["compiled"] = b.compiled;
            d["usable"] = b.usable;
            d["reason"] = b.reason;
            d["device"] = b.device;
            out.append(d);
          }
          return out;
        },
        nb::sig("def backends() -> list[dict[str, str | bool]]"),
        "Every backend Lily has, in the order a default choice tries them (cuda, metal, cpu), as dicts: name, "
        "compiled (built into this module), usable (and its device answers), reason (why not usable; \"\" if "
        "usable), device (what it runs on, when usable).");
  m.def("compiled_backends", &compiled_backends, "Names of the backends compiled into this build.");
  m.def("optimisations",
        [] {
          nb::list out;
          for (const OptInfo& o : optimisation_table()) out.append(nb::make_tuple(o.name, o.backends, o.what));
          return out;
        },
        "The ablation switches: (name, backends it changes, what it does) for each.");
  m.def("num_threads", &num_threads, "Threads the CPU backend uses (LILY_NUM_THREADS overrides).");

  nb::class_<PyModel>(m, "Model", "Weights of one qwen3_5_moe text model resident on a backend.")
      .def("__init__", &make_model, "config"_a, "tensors"_a, "sources"_a = nb::dict(), "backend"_a = "cpu",
           "mapped_files"_a = nb::dict(), "disable"_a = std::vector<std::string>(),
           "config: text config dict (architecture.md §1 names); tensors: canonical name → array (bf16 as uint16);\n"
           "sources: canonical name → file, for error messages; mapped_files: file name → uint8 view of its whole\n"
           "mapping (a SIGBUS inside one names the file); disable: names of optimisations to turn off. The model\n"
           "keeps every array alive.")
      .def_prop_ro("config", [](const PyModel& m) { return config_to_dict(m.model->config()); })
      .def_prop_ro("fingerprint", [](const PyModel& m) { return m.model->fingerprint(); },
                   "The identity of the weights (32 hex digits): config, tensor names, dtypes and shapes, and sampled "
                   "bytes of every tensor. Snapshots carry it; Session.restore requires it.")
      .def_prop_ro("reads_host_weights", [](const PyModel& m) { return m.model->weights().reads_host; },
                   "True when the backend reads weights in place from the host arrays (the mapped files), so they "
                   "must not change while the model lives.")
      .def_prop_ro("backend", [](const PyModel& m) { return m.model->backend().name(); })
      .def_prop_ro("device",
                   [](const PyModel& m) {
                     const Backend& be = m.model->backend();
                     const std::string device = be.device();  // the backend's name where it has no device of its own
                     return device == be.name() ? probe_backend(be.name()).device : device;
                   },
                   "The device the backend runs on (e.g. \"NVIDIA H200\", \"x86_64, 16 threads\").")
      .def_prop_ro("disabled",
                   [](const PyModel& m) { return m.model->backend().optimisations().disabled_names(); },
                   "Comma-separated names of the optimisations turned off (\"\" when all are on).")
      .def_prop_ro("default_prefill_chunk",
                   [](const PyModel& m) { return m.model->backend().default_prefill_chunk(); },
                   "Tokens per prefill call when a session sets none (chosen per backend from measurements).")
      .def_prop_ro("weight_bytes", [](const PyModel& m) { return m.model->weights().bytes; },
                   "Bytes of quantized weights bound.")
      .def_prop_ro("memory_in_use", [](const PyModel& m) { return m.model->backend().bytes_in_use(); },
                   "Backend bytes allocated now (resident weights, state, working buffers).")
      .def_prop_ro("peak_memory", [](const PyModel& m) { return m.model->backend().peak_bytes(); },
                   "Highest backend allocation since load or reset_peak_memory().")
      .def("reset_peak_memory", [](PyModel& m) { m.model->backend().reset_peak(); })
      .def("session",
           [](PyModel& m, int max_context, int prefill_chunk) {
             return new Session(*m.model, max_context > 0 ? max_context : m.model->config().max_position_embeddings,
                                prefill_chunk);
           },
           "max_context"_a = 0, "prefill_chunk"_a = 0, nb::keep_alive<0, 1>(),
           "A new empty session (max_context 0: the model's max_position_embeddings; prefill_chunk 0: the "
           "backend's default).");

  nb::class_<Snapshot>(m, "Snapshot",
                       "The complete state of a session at one position and the tokens it holds; in the backend's "
                       "memory where it had room (on_device), else in host memory. Copies share it.")
      .def_prop_ro("position", [](const Snapshot& s) { return s.pos; })
      .def_prop_ro("tokens", [](const Snapshot& s) { return s.tokens; },
                   "The tokens the state holds (position of them).")
      .def_prop_ro("on_device", &Snapshot::on_device, "True when the state lives in the backend's memory.")
      .def_prop_ro("fingerprint", [](const Snapshot& s) { return s.fingerprint; },
                   "The fingerprint of the model that made it.")
      .def_prop_ro("nbytes", &Snapshot::nbytes)
      .def("to_bytes",
           [](const Snapshot& s) {
             std::vector<uint8_t> b;
             {
               nb::gil_scoped_release release;
               b = s.serialize();
             }
             return nb::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           },
           "The snapshot as a self-describing byte string (for disk caches).")
      .def_static("from_bytes",
                  [](nb::bytes b) {
                    return Snapshot::deserialize(reinterpret_cast<const uint8_t*>(b.c_str()), b.size());
                  },
                  "data"_a, "A snapshot from to_bytes() output; ValueError if the data is not one.");

  nb::class_<Session>(m, "Session",
                      "The state of one sequence: KV caches, conv and recurrent states, position. Never shared: a "
                      "call while another thread is inside one raises SessionConflictError.")
      .def_prop_ro("position", &Session::position)
      .def_prop_ro("tokens",
                   [](const Session& s) {
                     Session::Hold hold(s);  // the holder's to change: read while no other thread is inside
                     return s.tokens();
                   },
                   "The tokens whose effect is in the state (position of them), as a new list.")
      .def_prop_ro("epoch", &Session::epoch,
                   "Changes whenever the state does (prefill, decode, reset, restore, a generation's set-up).")
      .def_prop_ro("max_context", &Session::max_context)
      .def_prop_ro("prefill_chunk", &Session::prefill_chunk)
      .def_prop_ro("tokens_processed", &Session::tokens_processed,
                   "Tokens run through the model by this session since it was made (prefill and decode).")
      .def("prefill",
           [](Session& s, const Tokens& tokens, const Progress& progress) {
             const int n = token_count(tokens);
             auto out = new_array({size_t(s.vocab_size())});
             const ChunkHook hook = python_hook(progress);
             nb::gil_scoped_release release;
             s.prefill(tokens.data(), n, out.data(), hook);
             return out;
           },
           "tokens"_a, "progress"_a = nb::none(),
           "Feeds tokens (int32 [n], n ≥ 1) in chunks; returns the fp32 logits of the last one. Between chunks, "
           "progress(done, n) is called and Ctrl-C is seen: an exception there (KeyboardInterrupt) stops the "
           "prefill with the session holding the chunks done (position says how many).")
      .def("feed",
           [](Session& s, const Tokens& tokens, const Progress& progress) {
             const int n = token_count(tokens);
             const ChunkHook hook = python_hook(progress);
             nb::gil_scoped_release release;
             s.prefill(tokens.data(), n, nullptr, hook);
           },
           "tokens"_a, "progress"_a = nb::none(),
           "Feeds tokens (int32 [n], n ≥ 1) in chunks and computes no logits (no lm_head, no copy); progress and "
           "interrupts as prefill().")
      .def("forward_all",
           [](Session& s, const Tokens& tokens, const Progress& progress) {
             const int n = token_count(tokens, &s);  // [n, vocab] fp32 is allocated here: refuse first
             auto out = new_array({size_t(n), size_t(s.vocab_size())});
             const ChunkHook hook = python_hook(progress);
             nb::gil_scoped_release release;
             s.forward_all(tokens.data(), n, out.data(), hook);
             return out;
           },
           "tokens"_a, "progress"_a = nb::none(),
           "Feeds tokens; returns the fp32 logits of every one, [n, vocab]; progress and interrupts as prefill().")
      .def("check_room", &Session::check_room, "n"_a,
           "Raises ValueError unless n more tokens fit within the session's context limit.")
      .def("reset", &Session::reset, nb::call_guard<nb::gil_scoped_release>())
      .def("reserve", &Session::reserve, "tokens"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Room for `tokens` more positions: the KV caches grown once now, not as they fill.")
      .def("snapshot", &Session::snapshot, nb::call_guard<nb::gil_scoped_release>())
      .def("save_at", &Session::save_at, "pos"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Asks the next prefill to snapshot the state on the way when it holds `pos` tokens (in the same forward "
           "passes); take_saved() returns it. The request lapses when that prefill ends.")
      .def("take_saved", &Session::take_saved, nb::call_guard<nb::gil_scoped_release>(),
           "The snapshot save_at asked for, or None if the prefill did not pass there; drops a pending request.")
      .def("restore", &Session::restore, "snapshot"_a, nb::call_guard<nb::gil_scoped_release>(),
           "Restores a snapshot of this model (ValueError for another model's, or another geometry's).");

  nb::class_<Generator>(m, "Generator",
                        "The decode loop of one generation on a session. If anything else changes the session "
                        "between its steps, its next step raises SessionConflictError.")
      .def(
          "__init__",
          [](Generator* g, Session& session, const SamplingParams& params, std::vector<int> eos_ids, int max_tokens,
             int n_valid, std::vector<int32_t> bias_ids, std::vector<float> bias_values, int min_tokens) {
            new (g) Generator(session, params, std::move(eos_ids), max_tokens, n_valid,
                              LogitBias{std::move(bias_ids), std::move(bias_values)}, min_tokens);
          },
          "session"_a, "params"_a, "eos_ids"_a, "max_tokens"_a, "n_valid"_a, nb::kw_only(),
          "bias_ids"_a = std::vector<int32_t>(), "bias_values"_a = std::vector<float>(), "min_tokens"_a = 0,
          nb::keep_alive<1, 2>(),
          "bias_values[k] is added to the logit of bias_ids[k] before the penalties; no eos id is drawn before "
          "min_tokens tokens are out. Either keeps the loop on the host.")
      .def("prefill",
           [](Generator& g, const Tokens& tokens, const Progress& progress) {
             const int n = token_count(tokens);
             const ChunkHook hook = python_hook(progress);
             nb::gil_scoped_release release;
             g.prefill(tokens.data(), n, hook);
           },
           "tokens"_a, "progress"_a = nb::none(),
           "Feeds the new prompt tokens; those already in the session count for penalties. Progress and "
           "interrupts as Session.prefill(); after an interrupt the generator cannot continue.")
      .def("next",
           [](Generator& g) {
             GenStep s;
             {
               nb::gil_scoped_release release;
               s = g.next();
             }
             return nb::make_tuple(s.token, s.logprob, s.top_ids, s.top_logprobs, int(s.finish));
           },
           nb::sig("def next(self) -> tuple[int, float, list[int], list[float], int]"),
           "One step: (token, logprob, top_ids, top_logprobs, finish) with finish 0 none, 1 stop (EOS), "
           "2 length. token is -1 when nothing more can be generated.")
      .def_prop_ro("on_device", &Generator::on_device, "True when the decode loop selects tokens on the device.")
      .def_prop_ro("generated", &Generator::generated)
      .def_prop_ro("tokens", &Generator::tokens, "The tokens next() returned, in order.");
}
