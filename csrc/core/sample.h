// csrc/core/sample.h
// Token sampling on the host: logit bias → penalties → temperature → top-k → top-p → min-p → renormalise
// → draw (vLLM's order; the bias first, as mlx-lm's and llama.cpp's). The NumPy oracle is src/lily/sampling.py
// (reference_probs, reference_sample).
//
// Kept set. Every filter is a threshold on the processed logit x, so the kept set is always
// {i < n_valid : x_i ≥ t} for one t, and ties at a boundary are kept or dropped together:
//   top-k  keep x_i ≥ (k-th largest x)
//   top-p  keep i iff the mass of the tokens strictly more probable than i is < top_p
//          (probabilities renormalised over the top-k set; equals vLLM's rule when there are no ties)
//   min-p  keep exp(x_i − x_max) ≥ min_p, i.e. p_i ≥ min_p·p_max
//
// Draw (counter-based, so that a GPU sampler can reproduce it without carrying RNG state):
//   u = to_unit_double(splitmix64(seed ^ (step · 0x9E3779B97F4A7C15)))      u ∈ [0, 1)
//   step = number of accept() calls so far. With w_i = exp(x_i − x_max) over the kept set (float) and
//   total = Σ w_i (double, ascending ids), the token is the first kept id, in ascending id order, whose
//   running sum of w exceeds u·total.
#pragma once

#include <cstdint>
#include <vector>

namespace lily {

struct SamplingParams {
  float temperature = 1.0f;          // 0 => greedy (argmax of the penalised logits; ties: lowest id)
  int top_k = 0;                     // 0 => off
  float top_p = 1.0f;                // 1 => off
  float min_p = 0.0f;                // 0 => off (relative to the max prob, after temperature)
  float repetition_penalty = 1.0f;   // HF/vLLM: logit>0 ? logit/p : logit*p, over prompt+generated ids seen
  float presence_penalty = 0.0f;     // OpenAI: logit -= presence if count>0; generated ids only
  float frequency_penalty = 0.0f;    // OpenAI: logit -= frequency*count; generated ids only
  uint64_t seed = 0;
  int top_logprobs = 0;              // number of top alternatives to report (0..20)
};

// Added to the logits of these ids before anything else (OpenAI's logit_bias). Host sampling only: it lives beside
// SamplingParams, which device samplers take by value, so that those stay plain data.
struct LogitBias {
  std::vector<int32_t> ids;   // distinct, in [0, n_valid)
  std::vector<float> values;  // finite, one per id
};

struct SampleResult {
  int token;
  float logprob;                     // log_softmax(raw logits)[token]: before penalties and temperature
  std::vector<int> top_ids;          // top_logprobs ids by raw logit, descending; ties: lowest id first
  std::vector<float> top_logprobs;   // their log_softmax(raw logits)
};

constexpr int kMaxTopLogprobs = 20;

// splitmix64 finaliser of x + 0x9E3779B97F4A7C15 (Steele, Lea, Flood 2014).
uint64_t splitmix64(uint64_t x);
// Top 53 bits as a double in [0, 1).
double to_unit_double(uint64_t x);

// One Sampler per sequence. Scratch is sized at construction; sample() allocates only the two short
// top_logprobs vectors of its result, and only when top_logprobs > 0.
class Sampler {
 public:
  // Throws std::invalid_argument naming the field. Logits at ids ≥ n_valid (vocab padding) are never chosen.
  Sampler(const SamplingParams& p, int vocab_size, int n_valid, const LogitBias& bias = {});
  void add_prompt(const int32_t* ids, int n);   // counts for repetition penalty only
  void accept(int token);                        // a generated token: counts for all penalties; advances step
  void ban(const std::vector<int>& ids);         // these ids cannot be drawn until the next ban() (ids in range)
  SampleResult sample(const float* logits);      // logits [vocab_size], not modified; does not call accept
  void probs(const float* logits, float* out);   // out [vocab_size]: the distribution sample() draws from

  const SamplingParams& params() const { return p_; }
  int vocab_size() const { return vocab_size_; }
  int n_valid() const { return n_valid_; }
  uint64_t step() const { return step_; }

 private:
  void process(const float* logits);   // x_ ← penalised, temperature-scaled logits
  int argmax() const;                  // lowest id on ties
  double select();                     // cand_, w_ ← kept ids (ascending) and weights; returns Σ w
  float top_p_threshold(int n, double target, float x_max);  // over vals_[0, n)

  SamplingParams p_;
  LogitBias bias_;
  std::vector<int> banned_;
  int vocab_size_, n_valid_;
  uint64_t step_ = 0;
  int n_cand_ = 0;
  std::vector<float> x_;          // [n_valid] processed logits
  std::vector<float> vals_;       // [n_valid] selection scratch
  std::vector<int> cand_;         // [n_valid] kept ids, ascending
  std::vector<float> w_;          // [n_valid] exp(x − x_max) of cand_
  std::vector<int32_t> count_;    // [n_valid] times generated
  std::vector<uint8_t> seen_;     // [n_valid] in the prompt or generated
  std::vector<int> seen_ids_;     // distinct seen ids (capacity n_valid)
  std::vector<int> gen_ids_;      // distinct generated ids (capacity n_valid)
};

}  // namespace lily
