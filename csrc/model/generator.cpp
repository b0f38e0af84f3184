#include "model/generator.h"

#include <algorithm>

#include "core/common.h"

namespace lily {

Generator::Generator(Session& session, const SamplingParams& params, std::vector<int> eos_ids, int max_tokens,
                     int n_valid)
    : s_(session),
      sampler_(params, session.vocab_size(), n_valid),
      eos_(std::move(eos_ids)),
      max_tokens_(max_tokens),
      logits_(session.vocab_size()) {
  LILY_CHECK(max_tokens >= 0, "max_tokens must be ≥ 0, got ", max_tokens);
}

void Generator::prefill(const int32_t* tokens, int n, const int32_t* history, int n_history) {
  LILY_CHECK(n >= 1, "the prompt must add at least one token to the session");
  s_.prefill(tokens, n, logits_.data());
  sampler_.add_prompt(history, n_history);
  sampler_.add_prompt(tokens, n);
  ready_ = true;
}

GenStep Generator::next() {
  LILY_CHECK(ready_, "Generator.next() called before prefill()");
  GenStep out;
  if (done_ || generated_ >= max_tokens_) {
    done_ = true;
    out.finish = Finish::Length;
    return out;
  }
  if (pending_ >= 0) {
    if (s_.position() >= s_.max_context()) {  // no room to feed the last token: the context is full
      done_ = true;
      out.finish = Finish::Length;
      return out;
    }
    s_.prefill(&pending_, 1, logits_.data());
  }
  SampleResult r = sampler_.sample(logits_.data());
  sampler_.accept(r.token);
  out.token = pending_ = r.token;
  out.logprob = r.logprob;
  out.top_ids = std::move(r.top_ids);
  out.top_logprobs = std::move(r.top_logprobs);
  ++generated_;
  if (std::find(eos_.begin(), eos_.end(), r.token) != eos_.end())
    out.finish = Finish::Stop;
  else if (generated_ >= max_tokens_)
    out.finish = Finish::Length;
  done_ = out.finish != Finish::None;
  return out;
}

}  // namespace lily
