// csrc/python/bind_sampling.cpp
// lily._core.SamplingParams / SampleResult / Sampler: thin bindings over core/sample.h.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "core/sample.h"

namespace nb = nanobind;
using namespace nb::literals;
using lily::SampleResult;
using lily::Sampler;
using lily::SamplingParams;

namespace {

using Logits = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

const float* checked(const Sampler& s, const Logits& logits, const char* where) {
  if (logits.shape(0) != static_cast<size_t>(s.vocab_size()))
    throw nb::value_error((std::string("Sampler.") + where + ": logits has " + std::to_string(logits.shape(0)) +
                           " entries, expected vocab_size=" + std::to_string(s.vocab_size()))
                              .c_str());
  return logits.data();
}

}  // namespace

void init_sampling(nb::module_& m) {
  const SamplingParams d;
  nb::class_<SamplingParams>(m, "SamplingParams", "Sampling parameters of one sequence (validated by Sampler).")
      .def(
          "__init__",
          [](SamplingParams* p, float temperature, int top_k, float top_p, float min_p, float repetition_penalty,
             float presence_penalty, float frequency_penalty, uint64_t seed, int top_logprobs) {
            new (p) SamplingParams{temperature,      top_k,             top_p, min_p,       repetition_penalty,
                                   presence_penalty, frequency_penalty, seed,  top_logprobs};
          },
          nb::kw_only(), "temperature"_a = d.temperature, "top_k"_a = d.top_k, "top_p"_a = d.top_p,
          "min_p"_a = d.min_p, "repetition_penalty"_a = d.repetition_penalty,
          "presence_penalty"_a = d.presence_penalty, "frequency_penalty"_a = d.frequency_penalty, "seed"_a = d.seed,
          "top_logprobs"_a = d.top_logprobs)
      .def_rw("temperature", &SamplingParams::temperature)
      .def_rw("top_k", &SamplingParams::top_k)
      .def_rw("top_p", &SamplingParams::top_p)
      .def_rw("min_p", &SamplingParams::min_p)
      .def_rw("repetition_penalty", &SamplingParams::repetition_penalty)
      .def_rw("presence_penalty", &SamplingParams::presence_penalty)
      .def_rw("frequency_penalty", &SamplingParams::frequency_penalty)
      .def_rw("seed", &SamplingParams::seed)
      .def_rw("top_logprobs", &SamplingParams::top_logprobs);

  nb::class_<SampleResult>(m, "SampleResult", "One sampled token; logprobs are log_softmax of the raw logits.")
      .def_ro("token", &SampleResult::token)
      .def_ro("logprob", &SampleResult::logprob)
      .def_ro("top_ids", &SampleResult::top_ids)
      .def_ro("top_logprobs", &SampleResult::top_logprobs);

  nb::class_<Sampler>(m, "Sampler", "Per-sequence sampler: penalties, temperature, top-k, top-p, min-p, draw.")
      .def(
          "__init__",
          [](Sampler* s, const SamplingParams& p, int vocab_size, int n_valid, std::vector<int32_t> bias_ids,
             std::vector<float> bias_values) {
            new (s) Sampler(p, vocab_size, n_valid, lily::LogitBias{std::move(bias_ids), std::move(bias_values)});
          },
          "params"_a, "vocab_size"_a, "n_valid"_a, nb::kw_only(), "bias_ids"_a = std::vector<int32_t>(),
          "bias_values"_a = std::vector<float>(), "bias_values[k] is added to the logit of bias_ids[k] first.")
      .def(
          "add_prompt",
          [](Sampler& s, const std::vector<int32_t>& ids) { s.add_prompt(ids.data(), static_cast<int>(ids.size())); },
          "ids"_a, "Count prompt ids for the repetition penalty.")
      .def("accept", &Sampler::accept, "token"_a, "Record a generated token (all penalties) and advance step.")
      .def("ban", &Sampler::ban, "ids"_a, "These ids cannot be drawn until the next ban() (min_tokens: the EOS ids).")
      .def(
          "sample", [](Sampler& s, const Logits& logits) { return s.sample(checked(s, logits, "sample")); },
          "logits"_a, "Draw a token from float32 logits [vocab_size]; does not call accept().")
      .def(
          "probs",
          [](Sampler& s, const Logits& logits) {
            const size_t n = static_cast<size_t>(s.vocab_size());
            float* out = new float[n];
            nb::capsule owner(out, [](void* p) noexcept { delete[] static_cast<float*>(p); });
            s.probs(checked(s, logits, "probs"), out);
            return nb::ndarray<nb::numpy, float, nb::ndim<1>>(out, {n}, owner);
          },
          "logits"_a, "The final distribution sample() draws from, as a new float32 array [vocab_size].")
      .def_prop_ro("params", &Sampler::params)
      .def_prop_ro("vocab_size", &Sampler::vocab_size)
      .def_prop_ro("n_valid", &Sampler::n_valid)
      .def_prop_ro("step", &Sampler::step);
}
