#include "model/generator.h"

#include <algorithm>
#include <atomic>

#include "core/common.h"

namespace lily {

Generator::Generator(Session& session, const SamplingParams& params, std::vector<int> eos_ids, int max_tokens,
                     int n_valid, const LogitBias& bias, int min_tokens)
    : s_(session),
      be_(session.backend()),
      params_(params),
      n_valid_(n_valid),
      sampler_(params, session.vocab_size(), n_valid, bias),
      eos_(std::move(eos_ids)),
      max_tokens_(max_tokens),
      min_tokens_(eos_.empty() ? 0 : min_tokens),
      logits_(session.vocab_size()) {
  LILY_CHECK(max_tokens >= 0, "max_tokens must be ≥ 0, got ", max_tokens);
  LILY_CHECK(min_tokens >= 0, "min_tokens must be ≥ 0, got ", min_tokens);
  Session::Hold hold(s_);
  epoch_ = s_.epoch();
  for (int id : eos_)
    if (id >= 0 && id < n_valid) eos_ban_.push_back(id);  // an id past the vocabulary is never drawn anyway
  device_ = bias.ids.empty() && min_tokens_ == 0 && be_.can_sample(params, n_valid);
  if (!device_) return;
  static std::atomic<uint64_t> serials{1};
  serial_ = serials++;
  auto take = [&](size_t bytes) {
    owned_.push_back(be_.alloc(bytes));
    be_.zero(owned_.back(), bytes);
    return owned_.back();
  };
  st_.counts = static_cast<int32_t*>(take(size_t(n_valid) * 4));
  st_.seen = static_cast<uint8_t*>(take(size_t(n_valid)));
  st_.step = static_cast<uint64_t*>(take(8));
  st_.results = static_cast<int32_t*>(take(2 * kResultSlots * 4));
  st_.token = s_.token_buffer();
  epoch_ = s_.epoch();
}

Generator::~Generator() {
  std::lock_guard<std::recursive_mutex> lock(s_.model().backend_lock());  // another session may be computing
  for (void* p : owned_) be_.release(p);
}

void Generator::check_epoch(const char* call) const {
  if (s_.epoch() != epoch_)
    throw SessionConflict(cat("Generator.", call, "(): the session was changed since this generation's last step "
                              "(a prefill, reset or restore, or another generation on the same session); this "
                              "generation cannot continue: start a new one"));
  if (device_ && ready_ && s_.model().device_loop_owner() != serial_)
    throw SessionConflict(cat("Generator.", call, "(): another generation on this model ran its device loop since "
                              "this generation's last step, over the backend's in-flight results; this generation "
                              "cannot continue: start a new one"));
}

void Generator::prefill(const int32_t* tokens, int n, const ChunkHook& hook) {
  Session::Hold hold(s_);
  check_epoch("prefill");
  LILY_CHECK(!ready_, "Generator.prefill() was already called: a generator runs one prompt");
  LILY_CHECK(n >= 1, "the prompt must add at least one token to the session");
  const std::vector<int32_t>& before = s_.tokens();  // already in the session: they count for the penalties
  const int32_t* history = before.data();
  const int n_history = int(before.size());
  sampler_.add_prompt(history, n_history);  // validates the ids (and, on the device path, marks them seen)
  sampler_.add_prompt(tokens, n);
  s_.reserve(int(std::min<int64_t>(int64_t(n) + max_tokens_, INT32_MAX)));  // the prompt and the reply, once
  if (!device_) {
    s_.prefill(tokens, n, logits_.data(), hook);
  } else {
    std::vector<uint8_t> seen(n_valid_, 0);
    for (int i = 0; i < n_history; ++i) seen[history[i]] = 1;
    for (int i = 0; i < n; ++i) seen[tokens[i]] = 1;
    be_.to_device(st_.seen, seen.data(), seen.size());
    s_.prefill_device(tokens, n, hook);
    st_.token = s_.token_buffer();
    if (max_tokens_ > 0) {
      s_.sample_device(params_, n_valid_, st_);
      be_.fetch_result(st_.results, 0);
      enqueued_ = 1;
    }
  }
  ready_ = true;
  epoch_ = s_.epoch();
  if (device_) s_.model().device_loop_owner() = serial_;
}

GenStep Generator::next() {
  LILY_CHECK(ready_, "Generator.next() called before prefill()");
  if (done_ || generated_ >= max_tokens_) {
    done_ = true;
    GenStep out;
    out.finish = Finish::Length;
    return out;
  }
  Session::Hold hold(s_);
  check_epoch("next");
  GenStep out = device_ ? next_device() : next_host();
  epoch_ = s_.epoch();
  return out;
}

GenStep Generator::finish(GenStep out, int token) {
  ++generated_;
  tokens_.push_back(token);
  if (std::find(eos_.begin(), eos_.end(), token) != eos_.end())
    out.finish = Finish::Stop;
  else if (generated_ >= max_tokens_)
    out.finish = Finish::Length;
  done_ = out.finish != Finish::None;
  return out;
}

GenStep Generator::next_host() {
  GenStep out;
  if (pending_ >= 0) {
    if (s_.position() >= s_.max_context()) {  // no room to feed the last token: the context is full
      done_ = true;
      out.finish = Finish::Length;
      return out;
    }
    s_.prefill(&pending_, 1, logits_.data());
  }
  if (min_tokens_ > 0) sampler_.ban(generated_ < min_tokens_ ? eos_ban_ : std::vector<int>());
  SampleResult r = sampler_.sample(logits_.data());
  sampler_.accept(r.token);
  out.token = pending_ = r.token;
  out.logprob = r.logprob;
  out.top_ids = std::move(r.top_ids);
  out.top_logprobs = std::move(r.top_logprobs);
  return finish(std::move(out), r.token);
}

GenStep Generator::next_device() {
  GenStep out;
  const int k = generated_;
  if (k >= enqueued_) {  // nothing was enqueued for this token: the context is full
    done_ = true;
    out.finish = Finish::Length;
    return out;
  }
  // Enqueue the step that feeds token k and selects token k+1 before waiting for token k.
  const bool feeds = k + 1 < max_tokens_ && s_.position() < s_.max_context();
  if (feeds) {
    s_.decode_device(params_, n_valid_, st_, serial_);
    be_.fetch_result(st_.results, (k + 1) % kResultSlots);
    enqueued_ = k + 2;
  }
  int32_t r[2];
  be_.wait_result(k % kResultSlots, r);
  if (feeds) s_.token_fed(r[0]);  // the state holds it: the session's tokens say so
  out.token = r[0];
  std::memcpy(&out.logprob, &r[1], 4);
  sampler_.accept(r[0]);  // the host mirror of the history (penalties of a later host-path generation)
  return finish(std::move(out), r[0]);
}

}  // namespace lily
