// config.h: the text-model configuration of qwen3_5_moe (architecture.md §1), filled by the Python loader
// from config.json and checked here once, before any weight is touched.
#pragma once
#include <string>

namespace lily {

// Limits of the config that keep every size the core computes from it inside an int and every per-layer list short
// (the loader checks the same ones first, in src/lily/loader.py). 512 layers is llama.cpp's LLAMA_MAX_LAYERS.
constexpr int kMaxLayers = 512;
constexpr int kMaxConvKernel = 9;

struct Config {
  int hidden_size = 0;                      // H
  int num_hidden_layers = 0;
  int full_attention_interval = 4;          // layer i is full attention iff (i+1) % interval == 0
  int num_attention_heads = 0;              // NH
  int num_key_value_heads = 0;              // NKV
  int head_dim = 0;                         // HD
  int linear_num_key_heads = 0;             // NK
  int linear_num_value_heads = 0;           // NV
  int linear_key_head_dim = 0;              // DK
  int linear_value_head_dim = 0;            // DV
  int linear_conv_kernel_dim = 4;           // K
  int num_experts = 0;                      // E
  int num_experts_per_tok = 0;              // top-k
  int moe_intermediate_size = 0;            // I
  int shared_expert_intermediate_size = 0;  // IS
  int vocab_size = 0;                       // V (padded rows included)
  int max_position_embeddings = 262144;
  double rope_theta = 1e7;
  double partial_rotary_factor = 0.25;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool norm_topk_prob = true;

  bool is_full_attention(int layer) const { return (layer + 1) % full_attention_interval == 0; }
  int key_dim() const { return linear_num_key_heads * linear_key_head_dim; }      // NK·DK
  int value_dim() const { return linear_num_value_heads * linear_value_head_dim; }  // NV·DV
  int conv_dim() const { return 2 * key_dim() + value_dim(); }
  int rotary_dim() const { return int(head_dim * partial_rotary_factor); }
  int num_full_attention_layers() const;

  // Throws InputError naming the config.json field when a value is impossible or past a limit (then naming the
  // limit), before anything is sized from the config.
  void validate() const;
};

}  // namespace lily
