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

// On a backend that selects tokens itself (Backend::can_sample), the loop runs on the device: each step feeds the
// previous token and selects the next one without the host, the host enqueues step k+1 before it waits for token k,
// and so the state then also holds the last returned token (Session::position() tells what it holds).
//
// A generation owns its session from one step to the next: it holds the session during each call (Session::Hold),
// and if anything else changed the session since its last step (a prefill, reset or restore, another generation),
// its next call throws SessionConflict instead of continuing from a state that is no longer its own.
class Generator {
 public:
  // n_valid: ids ≥ n_valid are vocabulary padding (never sampled). The first min_tokens tokens are never
  // end-of-sequence ids. A logit bias or a min_tokens keeps the loop on the host (the device samplers take neither).
  Generator(Session& session, const SamplingParams& params, std::vector<int> eos_ids, int max_tokens, int n_valid,
            const LogitBias& bias = {}, int min_tokens = 0);
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  // Feeds the prompt's new tokens (n ≥ 1) and keeps the logits of the last one. The tokens already in the session
  // count for the repetition penalty. `hook` runs between prefill chunks (model.h, ChunkHook); if it throws, the
  // session holds the chunks done and this generator cannot continue.
  void prefill(const int32_t* tokens, int n, const ChunkHook& hook = nullptr);
  // One generated token. The previous one is fed to the model first, so the state always holds every token
  // except the last one returned (which is "pending").
  GenStep next();
  int generated() const { return generated_; }
  // The tokens next() returned, in order.
  const std::vector<int>& tokens() const { return tokens_; }
  bool on_device() const { return device_; }

 private:
  GenStep next_host();
  GenStep next_device();
  GenStep finish(GenStep out, int token);
  // Throws SessionConflict unless the session is as this generation's last call left it.
  void check_epoch(const char* call) const;

  Session& s_;
  uint64_t epoch_ = 0;  // the session's epoch after this generation's last call
  Backend& be_;
  SamplingParams params_;
  int n_valid_;
  Sampler sampler_;
  std::vector<int> eos_;
  int max_tokens_;
  int min_tokens_;
  std::vector<int> eos_ban_;  // the end-of-sequence ids banned while fewer than min_tokens are out
  int generated_ = 0;
  std::vector<int> tokens_;
  int pending_ = -1;
  bool ready_ = false;
  bool done_ = false;
  std::vector<float> logits_;
  // device loop
  bool device_ = false;
  uint64_t serial_ = 0;  // distinguishes this generation's recorded decode step from earlier ones
  int enqueued_ = 0;     // tokens whose selection has been enqueued
  DeviceSampler st_;
  std::vector<void*> owned_;
};

}  // namespace lily
