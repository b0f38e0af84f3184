// generator.h: the decode loop. Samples a token from the current logits, then feeds it back for the next step;
// stops at an EOS id, at max_tokens or at the session's context limit. Text-level stop strings are the Python
// layer's job (they need the detokenizer).
#pragma once
#include <vector>

#include "core/sample.h"
#include "model/model.h"

namespace lily {

enum class Finish { None = 0, Stop = 1, Length = 2 };

struct GenStep {
  int token = -1;
  float logprob = 0.0f;
  std::vector<int> top_ids;
  std::vector<float> top_logprobs;
  Finish finish = Finish::None;
};

class Generator {
 public:
  // n_valid: ids ≥ n_valid are vocabulary padding (never sampled).
  Generator(Session& session, const SamplingParams& params, std::vector<int> eos_ids, int max_tokens, int n_valid);

  // Feeds the prompt's new tokens (n ≥ 1) and keeps the logits of the last one. `history` tokens already in the
  // session count for the repetition penalty.
  void prefill(const int32_t* tokens, int n, const int32_t* history, int n_history);
  // One generated token. The previous one is fed to the model first, so the state always holds every token
  // except the last one returned (which is "pending").
  GenStep next();
  int pending() const { return pending_; }
  int generated() const { return generated_; }
  const std::vector<float>& logits() const { return logits_; }

 private:
  Session& s_;
  Sampler sampler_;
  std::vector<int> eos_;
  int max_tokens_;
  int generated_ = 0;
  int pending_ = -1;
  bool ready_ = false;
  bool done_ = false;
  std::vector<float> logits_;
};

}  // namespace lily
