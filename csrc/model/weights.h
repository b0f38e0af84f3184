// weights.h: every tensor of the text model, bound to backend memory, one field per tensor with its shape.
// The table of names lives in weights.cpp (bind_weights); it is the single place that knows checkpoint keys.
#pragma once
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "core/config.h"

namespace lily {

// A tensor as the loader hands it over: a host view (usually of a memory-mapped shard) plus where it came from.
struct HostTensor {
  const void* data = nullptr;
  size_t nbytes = 0;           // bytes at data
  std::string dtype;           // "U32", "BF16", "F16", "F32"
  std::vector<int64_t> shape;
  std::string source;          // file name, for error messages
};
using TensorMap = std::unordered_map<std::string, HostTensor>;

struct LayerWeights {
  bool full_attention = false;
  const float* input_norm = nullptr;  // [H] fp32 (stored 1+w)
  const float* post_norm = nullptr;   // [H]
  // full attention (§4)
  QMatrix q_proj;                     // [NH·2·HD, H]  query and gate, interleaved per head
  QMatrix k_proj, v_proj;             // [NKV·HD, H]
  QMatrix o_proj;                     // [H, NH·HD]
  const float* q_norm = nullptr;      // [HD]
  const float* k_norm = nullptr;      // [HD]
  // Gated DeltaNet (§5)
  QMatrix in_proj_qkv;                // [2·NK·DK + NV·DV, H]
  QMatrix in_proj_z;                  // [NV·DV, H]
  QMatrix in_proj_b, in_proj_a;       // [NV, H]
  QMatrix out_proj;                   // [H, NV·DV]
  const float* conv1d = nullptr;      // [conv_dim, K]
  const float* A_log = nullptr;       // [NV]
  const float* dt_bias = nullptr;     // [NV]
  const float* gdn_norm = nullptr;    // [DV]
  // MoE (§6)
  MoeWeights moe;
};

struct Weights {
  QMatrix embed;                      // [V, H]
  QMatrix lm_head;                    // [V, H]
  const float* final_norm = nullptr;  // [H]
  std::vector<LayerWeights> layers;
  std::vector<void*> owned;           // backend buffers made at bind time (fp32 vectors, resident copies)
  size_t bytes = 0;                   // quantized bytes bound
  bool reads_host = false;            // some weight is read in place from the host arrays (zero copy), for good
};

// Checks presence, dtype and shape of every tensor against the config (InputError names the tensor and its
// file) and binds them to the backend: zero-copy where the backend shares host memory.
Weights bind_weights(const Config& cfg, const TensorMap& tensors, Backend& be);

// The identity of a model's weights, 32 hex digits: a hash of the config, of every tensor's name, dtype and shape
// (the content of the safetensors headers) and of sampled bytes of every tensor (its first, last and one middle
// kFingerprintWindow bytes, the middle one at an offset drawn from its name). Cheap at load (three pages per
// tensor) and independent of file names and times, so weights swapped for others of the same shapes are told
// apart. Not cryptographic: it tells models apart, it does not authenticate them.
constexpr size_t kFingerprintWindow = 256;
std::string fingerprint(const Config& cfg, const TensorMap& tensors);

}  // namespace lily
