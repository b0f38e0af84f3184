// weights.cpp: the checkpoint key table (architecture.md §9.2, canonical names without `language_model.`)
// and the checks that make a bad checkpoint an error message instead of a crash.
#include "model/weights.h"

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "core/common.h"

namespace lily {
namespace {

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

class Binder {
 public:
  Binder(const Config& cfg, const TensorMap& t, Backend& be, Weights& w) : cfg_(cfg), t_(t), be_(be), w_(w) {}

  bool has(const std::string& name) const { return t_.count(name) != 0; }

  const HostTensor& get(const std::string& name) const {
    auto it = t_.find(name);
    LILY_CHECK(it != t_.end(), "checkpoint is missing tensor '", name, "'");
    return it->second;
  }

  // The checks of q() and vec() make the bytes read follow from the shape and dtype; this states it.
  static const void* span(const std::string& name, const HostTensor& t, size_t bytes) {
    LILY_ASSERT(bytes <= t.nbytes, "tensor '", name, "': ", bytes, " bytes would be read from a ", t.nbytes,
                "-byte array");
    return t.data;
  }

  static std::string where(const std::string& name, const HostTensor& t) {
    return cat("tensor '", name, "'", t.source.empty() ? "" : cat(" (", t.source, ")"));
  }

  void expect(const std::string& name, const HostTensor& t, const std::vector<int64_t>& shape, const char* what) {
    LILY_CHECK(t.shape == shape, where(name, t), ": shape ", shape_str(t.shape), " does not match the config, which implies ",
               shape_str(shape), " (", what, ")");
  }

  // A quantized linear (or expert stack when E > 0): N outputs, K inputs. bits and group size come from the shapes.
  QMatrix q(const std::string& prefix, int E, int N, int K) {
    const HostTensor& w = get(prefix + ".weight");
    const HostTensor& s = get(prefix + ".scales");
    const HostTensor& b = get(prefix + ".biases");
    LILY_CHECK(w.dtype == "U32", where(prefix + ".weight", w), ": dtype ", w.dtype,
               ", expected U32 (packed quantized codes; Lily runs MLX 4/8-bit checkpoints)");
    LILY_CHECK(s.dtype == "BF16", where(prefix + ".scales", s), ": dtype ", s.dtype, ", expected BF16");
    LILY_CHECK(b.dtype == "BF16", where(prefix + ".biases", b), ": dtype ", b.dtype, ", expected BF16");
    const size_t rank = E > 0 ? 3 : 2;
    LILY_CHECK(w.shape.size() == rank && s.shape.size() == rank, where(prefix + ".weight", w), ": shape ",
               shape_str(w.shape), " has the wrong rank, expected ", rank, " dimensions");
    const int64_t cols = w.shape.back(), groups = s.shape.back();
    LILY_CHECK(cols > 0 && (32 * cols) % K == 0 && (32 * cols / K == 4 || 32 * cols / K == 8),
               where(prefix + ".weight", w), ": shape ", shape_str(w.shape), " implies ", double(32 * cols) / K,
               " bits per weight for an input width of ", K, "; Lily supports 4 and 8 bits");
    LILY_CHECK(groups > 0 && K % groups == 0 && (K / groups == 32 || K / groups == 64 || K / groups == 128),
               where(prefix + ".scales", s), ": shape ", shape_str(s.shape), " implies group size ",
               double(K) / double(groups ? groups : 1), " for an input width of ", K, "; supported: 32, 64, 128");
    QMatrix m;
    m.E = E > 0 ? E : 1;
    m.N = N;
    m.K = K;
    m.bits = int(32 * cols / K);
    m.group = int(K / groups);
    std::vector<int64_t> lead = E > 0 ? std::vector<int64_t>{E, N} : std::vector<int64_t>{N};
    auto with = [&](int64_t last) { auto v = lead; v.push_back(last); return v; };
    expect(prefix + ".weight", w, with(cols), "[experts,] out, in·bits/32");
    expect(prefix + ".scales", s, with(groups), "[experts,] out, in/group");
    expect(prefix + ".biases", b, with(groups), "[experts,] out, in/group");
    const size_t n_words = size_t(m.E) * N * m.words_per_row(), n_groups = size_t(m.E) * N * groups;
    m.w = static_cast<const uint32_t*>(be_.weight(span(prefix + ".weight", w, n_words * 4), n_words * 4));
    m.scales = static_cast<const uint16_t*>(be_.weight(span(prefix + ".scales", s, n_groups * 2), n_groups * 2));
    m.biases = static_cast<const uint16_t*>(be_.weight(span(prefix + ".biases", b, n_groups * 2), n_groups * 2));
    w_.reads_host = w_.reads_host || static_cast<const void*>(m.w) == w.data ||
                    static_cast<const void*>(m.scales) == s.data || static_cast<const void*>(m.biases) == b.data;
    w_.bytes += n_words * 4 + n_groups * 4;
    return m;
  }

  // A small float vector or matrix, converted to fp32 backend memory.
  const float* vec(const std::string& name, const std::vector<int64_t>& shape, const char* what) {
    const HostTensor& t = get(name);
    // conv1d is [C, K, 1] in MLX checkpoints; the loader reorders HF's [C, 1, K] to it.
    expect(name, t, shape, what);
    size_t n = 1;
    for (auto d : shape) n *= size_t(d);
    std::vector<float> host(n);
    if (t.dtype == "F32") {
      std::memcpy(host.data(), span(name, t, n * 4), n * 4);
    } else if (t.dtype == "BF16") {
      auto p = static_cast<const uint16_t*>(span(name, t, n * 2));
      for (size_t i = 0; i < n; ++i) host[i] = bf16_to_f32(p[i]);
    } else {
      throw InputError(cat(where(name, t), ": dtype ", t.dtype, ", expected BF16 or F32"));
    }
    void* dev = be_.alloc(n * 4);
    w_.owned.push_back(dev);
    be_.to_device(dev, host.data(), n * 4);
    return static_cast<const float*>(dev);
  }

 private:
  const Config& cfg_;
  const TensorMap& t_;
  Backend& be_;
  Weights& w_;
};

}  // namespace

Weights bind_weights(const Config& c, const TensorMap& tensors, Backend& be) {
  Weights w;
  Binder b(c, tensors, be, w);
  const int H = c.hidden_size, V = c.vocab_size;
  w.embed = b.q("model.embed_tokens", 0, V, H);
  if (b.has("lm_head.weight") || !c.tie_word_embeddings)
    w.lm_head = b.q("lm_head", 0, V, H);
  else
    w.lm_head = w.embed;
  w.final_norm = b.vec("model.norm.weight", {H}, "hidden_size");
  for (int il = 0; il < c.num_hidden_layers; ++il) {
    const std::string p = cat("model.layers.", il, ".");
    LayerWeights L;
    L.full_attention = c.is_full_attention(il);
    L.input_norm = b.vec(p + "input_layernorm.weight", {H}, "hidden_size");
    L.post_norm = b.vec(p + "post_attention_layernorm.weight", {H}, "hidden_size");
    if (L.full_attention) {
      const int NH = c.num_attention_heads, NKV = c.num_key_value_heads, HD = c.head_dim;
      L.q_proj = b.q(p + "self_attn.q_proj", 0, NH * 2 * HD, H);
      L.k_proj = b.q(p + "self_attn.k_proj", 0, NKV * HD, H);
      L.v_proj = b.q(p + "self_attn.v_proj", 0, NKV * HD, H);
      L.o_proj = b.q(p + "self_attn.o_proj", 0, H, NH * HD);
      L.q_norm = b.vec(p + "self_attn.q_norm.weight", {HD}, "head_dim");
      L.k_norm = b.vec(p + "self_attn.k_norm.weight", {HD}, "head_dim");
    } else {
      const int NV = c.linear_num_value_heads;
      L.in_proj_qkv = b.q(p + "linear_attn.in_proj_qkv", 0, c.conv_dim(), H);
      L.in_proj_z = b.q(p + "linear_attn.in_proj_z", 0, c.value_dim(), H);
      L.in_proj_b = b.q(p + "linear_attn.in_proj_b", 0, NV, H);
      L.in_proj_a = b.q(p + "linear_attn.in_proj_a", 0, NV, H);
      L.out_proj = b.q(p + "linear_attn.out_proj", 0, H, c.value_dim());
      L.conv1d = b.vec(p + "linear_attn.conv1d.weight", {c.conv_dim(), c.linear_conv_kernel_dim, 1},
                       "conv channels 2·NK·DK + NV·DV, kernel, 1");
      L.A_log = b.vec(p + "linear_attn.A_log", {NV}, "linear_num_value_heads");
      L.dt_bias = b.vec(p + "linear_attn.dt_bias", {NV}, "linear_num_value_heads");
      L.gdn_norm = b.vec(p + "linear_attn.norm.weight", {c.linear_value_head_dim}, "linear_value_head_dim");
    }
    const int E = c.num_experts, I = c.moe_intermediate_size, IS = c.shared_expert_intermediate_size;
    MoeWeights& m = L.moe;
    m.router = b.q(p + "mlp.gate", 0, E, H);
    m.gate = b.q(p + "mlp.switch_mlp.gate_proj", E, I, H);
    m.up = b.q(p + "mlp.switch_mlp.up_proj", E, I, H);
    m.down = b.q(p + "mlp.switch_mlp.down_proj", E, H, I);
    m.shared_gate = b.q(p + "mlp.shared_expert.gate_proj", 0, IS, H);
    m.shared_up = b.q(p + "mlp.shared_expert.up_proj", 0, IS, H);
    m.shared_down = b.q(p + "mlp.shared_expert.down_proj", 0, H, IS);
    m.shared_expert_gate = b.q(p + "mlp.shared_expert_gate", 0, 1, H);
    w.layers.push_back(L);
  }
  // Tensors of layers the config does not have mean the config disagrees with the checkpoint.
  for (const auto& [name, t] : tensors) {
    if (name.rfind("model.layers.", 0) != 0) continue;
    const int il = std::atoi(name.c_str() + 13);
    LILY_CHECK(il < c.num_hidden_layers, Binder::where(name, t), " belongs to layer ", il,
               ", but config.json says num_hidden_layers = ", c.num_hidden_layers);
  }
  return w;
}

namespace {

// Two independent 64-bit lanes (FNV-1a and a multiply-rotate hash), each finished with splitmix64's mixer.
class Hash128 {
 public:
  void bytes(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) {
      a_ = (a_ ^ p[i]) * 0x100000001b3ull;
      b_ = ((b_ << 23 | b_ >> 41) ^ p[i]) * 0x9e3779b97f4a7c15ull;
    }
  }
  void text(const std::string& s) {
    const uint64_t n = s.size();
    bytes(&n, sizeof n);  // length first: ("ab", "c") and ("a", "bc") differ
    bytes(s.data(), s.size());
  }
  uint64_t value() const { return mix(a_); }
  std::string hex() const {
    static const char digits[] = "0123456789abcdef";
    std::string out;
    for (uint64_t v : {mix(a_), mix(b_ ^ a_)})
      for (int shift = 60; shift >= 0; shift -= 4) out += digits[(v >> shift) & 15];
    return out;
  }

 private:
  static uint64_t mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t a_ = 0xcbf29ce484222325ull, b_ = 0x243f6a8885a308d3ull;
};

}  // namespace

std::string fingerprint(const Config& c, const TensorMap& tensors) {
  Hash128 h;
  h.text(cat(c.hidden_size, ",", c.num_hidden_layers, ",", c.full_attention_interval, ",", c.num_attention_heads, ",",
             c.num_key_value_heads, ",", c.head_dim, ",", c.linear_num_key_heads, ",", c.linear_num_value_heads, ",",
             c.linear_key_head_dim, ",", c.linear_value_head_dim, ",", c.linear_conv_kernel_dim, ",", c.num_experts,
             ",", c.num_experts_per_tok, ",", c.moe_intermediate_size, ",", c.shared_expert_intermediate_size, ",",
             c.vocab_size, ",", c.max_position_embeddings, ",", c.tie_word_embeddings, ",", c.norm_topk_prob));
  for (double v : {c.rope_theta, c.partial_rotary_factor, c.rms_norm_eps}) h.bytes(&v, sizeof v);  // exact bits
  std::vector<const std::string*> names;
  for (const auto& [name, t] : tensors) names.push_back(&name);
  std::sort(names.begin(), names.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
  for (const std::string* name : names) {
    const HostTensor& t = tensors.at(*name);
    h.text(*name);
    h.text(t.dtype);
    h.text(cat(t.shape.size(), ":"));
    for (int64_t d : t.shape) h.bytes(&d, sizeof d);
    h.bytes(&t.nbytes, sizeof t.nbytes);
    const auto* p = static_cast<const uint8_t*>(t.data);
    const size_t W = kFingerprintWindow;
    if (t.nbytes <= 3 * W) {
      h.bytes(p, t.nbytes);
      continue;
    }
    Hash128 pick;  // the middle window's offset: deterministic, different for every tensor
    pick.text(*name);
    const size_t middle = W + pick.value() % (t.nbytes - 3 * W + 1);
    h.bytes(p, W);
    h.bytes(p + middle, W);
    h.bytes(p + t.nbytes - W, W);
  }
  return h.hex();
}

}  // namespace lily
