// csrc/core/sample.cpp
// sample: pick the next token from one row of logits (host reference; the device `sample` ops match it).
//
// Math     x = logits[0, n_valid)                                         (padding rows never kept)
//          bias        x_i ← x_i + b_i                                        for the ids of LogitBias
//          ban         x_i ← −∞ for the ids of the last ban() (min_tokens: no end-of-sequence yet), after the rest
//          penalties   x_i ← x_i>0 ? x_i/r : x_i·r           for i in prompt ∪ generated  (repetition, HF/vLLM)
//                      x_i ← x_i − f·count_i − s·[count_i>0]  for i in generated          (frequency, presence)
//          temperature x ← x / T;  T = 0: token = argmax x (lowest id on ties), no draw
//          top-k       keep x_i ≥ k-th largest x                              (ties kept together)
//          top-p       keep i iff Σ_{j kept, x_j > x_i} w_j < top_p·Σ_{j kept} w_j,  w = exp(x − x_max)
//          min-p       keep w_i ≥ min_p
//          draw        u = to_unit_double(splitmix64(seed ^ step·0x9E3779B97F4A7C15));
//                      first kept id (ascending) with Σ_{j ≤ id, kept} w_j > u·Σ_kept w
//          logprobs    log_softmax of the RAW logits over [0, n_valid)       (OpenAI / vLLM / mlx-lm)
// Layout   logits f32[vocab_size] row-contiguous; n_valid ≤ vocab_size (Qwen3.6: 248077 of 248320)
// Traffic  V = 248320: logits 0.99 MB read once, x/vals scratch 2 × 0.99 MB; penalties touch distinct seen ids only
// Work     O(V): one copy, one heap pass (top-k), one exp pass (logprobs); top-p halves the candidates with
//          nth_element towards the position where the sorted mass reaches top_p, then sorts ≤ 256 of them
// Checks   params and the logit bias (distinct ids in [0, n_valid), finite values) validated in the constructor;
//          logits without NaN/+inf and not all −inf; ids in [0, n_valid)
// Ref      src/lily/sampling.py reference_probs / reference_sample · Test tests/test_sampling.py
// History  v1 threshold selection + counter-based draw · v2 (current) logit bias and ban (min_tokens), host only
#include "core/sample.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace lily {

uint64_t splitmix64(uint64_t x) {
  uint64_t z = x + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double to_unit_double(uint64_t x) { return static_cast<double>(x >> 11) * 0x1.0p-53; }

static void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument("SamplingParams." + msg);
}

Sampler::Sampler(const SamplingParams& p, int vocab_size, int n_valid, const LogitBias& bias)
    : p_(p), bias_(bias), vocab_size_(vocab_size), n_valid_(n_valid) {
  // Negated comparisons so that NaN fails too.
  require(p.temperature >= 0 && std::isfinite(p.temperature), "temperature must be finite and >= 0");
  require(p.top_k >= 0, "top_k must be >= 0 (0 = off)");
  require(p.top_p > 0 && p.top_p <= 1, "top_p must be in (0, 1]");
  require(p.min_p >= 0 && p.min_p <= 1, "min_p must be in [0, 1]");
  require(p.repetition_penalty > 0 && std::isfinite(p.repetition_penalty), "repetition_penalty must be finite and > 0");
  require(std::isfinite(p.presence_penalty), "presence_penalty must be finite");
  require(std::isfinite(p.frequency_penalty), "frequency_penalty must be finite");
  require(p.top_logprobs >= 0 && p.top_logprobs <= kMaxTopLogprobs, "top_logprobs must be in 0..20");
  if (n_valid < 1 || n_valid > vocab_size)
    throw std::invalid_argument("Sampler: need 1 <= n_valid <= vocab_size, got n_valid=" + std::to_string(n_valid) +
                                ", vocab_size=" + std::to_string(vocab_size));
  require(bias.ids.size() == bias.values.size(), "logit_bias: " + std::to_string(bias.ids.size()) + " ids but " +
                                                     std::to_string(bias.values.size()) + " values");
  std::vector<int32_t> sorted = bias.ids;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    require(sorted[i] >= 0 && sorted[i] < n_valid, "logit_bias: token id " + std::to_string(sorted[i]) +
                                                       " outside [0, n_valid=" + std::to_string(n_valid) + ")");
    require(i == 0 || sorted[i] != sorted[i - 1], "logit_bias: token id " + std::to_string(sorted[i]) + " twice");
  }
  for (float v : bias.values) require(std::isfinite(v), "logit_bias: every value must be finite");
  x_.resize(n_valid);
  vals_.resize(n_valid);
  cand_.resize(n_valid);
  w_.resize(n_valid);
  count_.assign(n_valid, 0);
  seen_.assign(n_valid, 0);
  seen_ids_.reserve(n_valid);
  gen_ids_.reserve(n_valid);
}

static void check_id(const char* where, int id, int n_valid) {
  if (id < 0 || id >= n_valid)
    throw std::invalid_argument(std::string("Sampler.") + where + ": token id " + std::to_string(id) +
                                " outside [0, n_valid=" + std::to_string(n_valid) + ")");
}

void Sampler::add_prompt(const int32_t* ids, int n) {
  for (int i = 0; i < n; ++i) check_id("add_prompt", ids[i], n_valid_);
  for (int i = 0; i < n; ++i)
    if (!seen_[ids[i]]) seen_[ids[i]] = 1, seen_ids_.push_back(ids[i]);
}

void Sampler::accept(int token) {
  check_id("accept", token, n_valid_);
  if (!seen_[token]) seen_[token] = 1, seen_ids_.push_back(token);
  if (count_[token]++ == 0) gen_ids_.push_back(token);
  ++step_;
}

void Sampler::ban(const std::vector<int>& ids) {
  for (int id : ids) check_id("ban", id, n_valid_);
  banned_ = ids;
}

void Sampler::process(const float* logits) {
  for (int i = 0; i < n_valid_; ++i) {
    float v = logits[i];
    if (std::isnan(v) || v == std::numeric_limits<float>::infinity())
      throw std::invalid_argument("Sampler: logits[" + std::to_string(i) + "] is " + std::to_string(v));
    x_[i] = v;
  }
  for (size_t k = 0; k < bias_.ids.size(); ++k) x_[bias_.ids[k]] += bias_.values[k];
  const float r = p_.repetition_penalty, f = p_.frequency_penalty, s = p_.presence_penalty;
  if (r != 1.0f)
    for (int i : seen_ids_) x_[i] = x_[i] > 0 ? x_[i] / r : x_[i] * r;
  if (f != 0.0f || s != 0.0f)
    for (int i : gen_ids_) x_[i] -= f * static_cast<float>(count_[i]) + s;
  if (p_.temperature > 0)
    for (float& v : x_) v /= p_.temperature;
  for (int i : banned_) x_[i] = -std::numeric_limits<float>::infinity();
}

// A plain max loop vectorises; std::max_element's index chain runs ~5x slower.
static float max_of(const float* x, int n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

int Sampler::argmax() const {
  const float m = max_of(x_.data(), n_valid_);
  if (!std::isfinite(m))
    throw std::invalid_argument("Sampler: no finite logit after penalties and temperature (max is " +
                                std::to_string(m) + ")");
  return static_cast<int>(std::find(x_.begin(), x_.end(), m) - x_.begin());
}

// k-th largest of x[0, n) (duplicates counted): a min-heap of the k largest so far. On unsorted data most
// elements fail the first comparison, so this is one pass for small k.
static float kth_largest(const float* x, int n, int k, float* heap) {
  const auto cmp = std::greater<float>();
  std::copy(x, x + k, heap);
  std::make_heap(heap, heap + k, cmp);
  for (int i = k; i < n; ++i)
    if (x[i] > heap[0]) {
      std::pop_heap(heap, heap + k, cmp);
      heap[k - 1] = x[i];
      std::push_heap(heap, heap + k, cmp);
    }
  return heap[0];
}

float Sampler::top_p_threshold(int n, double target, float x_max) {
  // vals_[0, n) holds candidate x. In descending order, the threshold is the value at the first position
  // where the running mass reaches target (ties with it are kept: their strictly-greater mass is below target).
  // Find that position by halving: partition around the middle and keep the half the crossing lies in.
  float* v = vals_.data();
  const auto desc = std::greater<float>();
  int lo = 0, hi = n;
  double above = 0;  // mass of v[0, lo), all ≥ v[lo, hi)
  while (hi - lo > 256) {
    const int mid = lo + (hi - lo) / 2;
    std::nth_element(v + lo, v + mid, v + hi, desc);
    double m = 0;
    for (int j = lo; j < mid; ++j) m += std::exp(v[j] - x_max);
    if (above + m >= target) {
      hi = mid;
    } else {
      above += m;
      lo = mid;
    }
  }
  std::sort(v + lo, v + hi, desc);
  for (int j = lo; j < hi; ++j)
    if ((above += std::exp(v[j] - x_max)) >= target) return v[j];
  return v[hi - 1];  // not reached (up to rounding): then keep all of v[lo, hi)
}

double Sampler::select() {
  const int k = p_.top_k;
  float t = -std::numeric_limits<float>::infinity();
  if (k > 0 && k < n_valid_) t = kth_largest(x_.data(), n_valid_, k, vals_.data());
  const float x_max = x_[argmax()];
  auto keep_at_least = [&](float thr) {  // cand_ ← {i : x_i ≥ thr}, ascending (branch-free compaction)
    n_cand_ = 0;
    for (int i = 0; i < n_valid_; ++i) {
      cand_[n_cand_] = i;
      n_cand_ += x_[i] >= thr;
    }
  };
  keep_at_least(t);
  if (p_.top_p < 1.0f) {
    double total = 0;
    for (int j = 0; j < n_cand_; ++j) total += (w_[j] = std::exp(x_[cand_[j]] - x_max));
    // Tokens lighter than (total − target)/n weigh less than total − target together, so the mass reaches
    // target among the others: only those go to the search.
    const double target = p_.top_p * total, light = (total - target) / n_cand_;
    int m = 0;
    for (int j = 0; j < n_cand_; ++j) {
      vals_[m] = x_[cand_[j]];
      m += w_[j] >= light;
    }
    keep_at_least(top_p_threshold(m, target, x_max));
  }
  double total = 0;
  int n = 0;
  for (int j = 0; j < n_cand_; ++j) {
    const float w = std::exp(x_[cand_[j]] - x_max);
    if (w < p_.min_p) continue;
    cand_[n] = cand_[j];
    w_[n++] = w;
    total += w;
  }
  n_cand_ = n;
  return total;
}

SampleResult Sampler::sample(const float* logits) {
  process(logits);
  SampleResult r{};
  if (p_.temperature == 0) {
    r.token = argmax();
  } else {
    const double total = select();
    const double target = to_unit_double(splitmix64(p_.seed ^ (step_ * 0x9E3779B97F4A7C15ull))) * total;
    double cum = 0;  // ends at total, summed in select()'s order, and u·total < total: the loop always stops
    int j = 0;
    while ((cum += w_[j]) <= target && j + 1 < n_cand_) ++j;
    r.token = cand_[j];
  }
  // log_softmax of the raw logits (process() has already checked them).
  const float raw_max = max_of(logits, n_valid_);
  double sum = 0;
  for (int i = 0; i < n_valid_; ++i) sum += std::exp(logits[i] - raw_max);
  const double lse = raw_max + std::log(sum);
  r.logprob = static_cast<float>(logits[r.token] - lse);
  if (const int n = p_.top_logprobs; n > 0) {
    int* idx = cand_.data();
    std::iota(idx, idx + n_valid_, 0);
    const int m = std::min(n, n_valid_);
    std::partial_sort(idx, idx + m, idx + n_valid_,
                      [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
    r.top_ids.assign(idx, idx + m);
    r.top_logprobs.resize(m);
    for (int i = 0; i < m; ++i) r.top_logprobs[i] = static_cast<float>(logits[idx[i]] - lse);
  }
  return r;
}

void Sampler::probs(const float* logits, float* out) {
  process(logits);
  std::fill(out, out + vocab_size_, 0.0f);
  if (p_.temperature == 0) {
    out[argmax()] = 1.0f;
    return;
  }
  const double total = select();
  for (int j = 0; j < n_cand_; ++j) out[cand_[j]] = static_cast<float>(w_[j] / total);
}

}  // namespace lily
