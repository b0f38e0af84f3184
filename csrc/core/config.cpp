#include "core/config.h"

#include <climits>
#include <cmath>
#include <cstdint>

#include "core/common.h"

namespace lily {

int Config::num_full_attention_layers() const {
  int n = 0;
  for (int i = 0; i < num_hidden_layers; ++i) n += is_full_attention(i);
  return n;
}

void Config::validate() const {
  auto positive = [](int v, const char* field) {
    LILY_CHECK(v > 0, "config.json: text_config.", field, " must be a positive integer, got ", v);
  };
  positive(hidden_size, "hidden_size");
  positive(num_hidden_layers, "num_hidden_layers");
  positive(full_attention_interval, "full_attention_interval");
  positive(num_attention_heads, "num_attention_heads");
  positive(num_key_value_heads, "num_key_value_heads");
  positive(head_dim, "head_dim");
  positive(linear_num_key_heads, "linear_num_key_heads");
  positive(linear_num_value_heads, "linear_num_value_heads");
  positive(linear_key_head_dim, "linear_key_head_dim");
  positive(linear_value_head_dim, "linear_value_head_dim");
  positive(linear_conv_kernel_dim, "linear_conv_kernel_dim");
  positive(num_experts, "num_experts");
  positive(num_experts_per_tok, "num_experts_per_tok");
  positive(moe_intermediate_size, "moe_intermediate_size");
  positive(shared_expert_intermediate_size, "shared_expert_intermediate_size");
  positive(vocab_size, "vocab_size");
  positive(max_position_embeddings, "max_position_embeddings");
  LILY_CHECK(num_hidden_layers <= kMaxLayers, "config.json: text_config.num_hidden_layers (", num_hidden_layers,
             ") exceeds the limit of ", kMaxLayers, " layers");
  LILY_CHECK(linear_conv_kernel_dim <= kMaxConvKernel, "config.json: text_config.linear_conv_kernel_dim (",
             linear_conv_kernel_dim, ") exceeds the limit of ", kMaxConvKernel);
  // Sizes the core computes as int (matrix rows and columns, state widths).
  auto fits = [](int64_t v, const char* what) {
    LILY_CHECK(v <= INT_MAX, "config.json: text_config sizes: ", what, " = ", v, " exceeds the limit of ", INT_MAX);
  };
  const int64_t NH = num_attention_heads, NKV = num_key_value_heads, HD = head_dim;
  const int64_t NK = linear_num_key_heads, NV = linear_num_value_heads, DK = linear_key_head_dim,
                DV = linear_value_head_dim;
  fits(2 * NH * HD, "2 * num_attention_heads * head_dim");
  fits(NKV * HD, "num_key_value_heads * head_dim");
  fits(2 * NK * DK + NV * DV, "2 * linear_num_key_heads * linear_key_head_dim + linear_num_value_heads * "
                              "linear_value_head_dim");
  fits(NV * DV * DK, "linear_num_value_heads * linear_value_head_dim * linear_key_head_dim");
  LILY_CHECK(num_attention_heads % num_key_value_heads == 0,
             "config.json: text_config.num_attention_heads (", num_attention_heads,
             ") must be a multiple of num_key_value_heads (", num_key_value_heads, ")");
  LILY_CHECK(linear_num_value_heads % linear_num_key_heads == 0,
             "config.json: text_config.linear_num_value_heads (", linear_num_value_heads,
             ") must be a multiple of linear_num_key_heads (", linear_num_key_heads, ")");
  LILY_CHECK(num_experts_per_tok <= num_experts, "config.json: text_config.num_experts_per_tok (",
             num_experts_per_tok, ") exceeds num_experts (", num_experts, ")");
  LILY_CHECK(partial_rotary_factor > 0 && partial_rotary_factor <= 1,
             "config.json: partial_rotary_factor must be in (0, 1], got ", partial_rotary_factor);
  LILY_CHECK(rotary_dim() % 2 == 0 && rotary_dim() > 0,
             "config.json: head_dim * partial_rotary_factor must be a positive even number, got ", rotary_dim());
  LILY_CHECK(rope_theta > 0 && std::isfinite(rope_theta), "config.json: rope_theta must be a finite positive "
             "number, got ", rope_theta);
  LILY_CHECK(rms_norm_eps > 0 && std::isfinite(rms_norm_eps), "config.json: rms_norm_eps must be a finite positive "
             "number, got ", rms_norm_eps);
}

}  // namespace lily
