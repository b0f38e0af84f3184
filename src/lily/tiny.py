"""Lily's built-in random checkpoints in the MLX 4-bit layout, and MLX's affine quantizer in NumPy.

`build_tiny` makes a small model with the real architecture (every tensor of architecture.md §12, same
dtypes, 4-bit g64 linears with an 8-bit router and shared-expert gate) from quantized Gaussian weights,
scaled so that a forward pass is numerically sensible. `build_random` makes any geometry, up to the full
35B one, by drawing quantized codes, scales and biases directly. `write_checkpoint` saves a checkpoint
the way mlx-lm does, so that `load_checkpoint(write_checkpoint(ckpt, d))` gives back the same tensors.
"""

import json
import math
import zlib
from pathlib import Path

import numpy as np

from lily.loader import (INPUT_WIDTH, MODEL_TYPE, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, Checkpoint,
                         config_from_text_config, input_widths, module_kind, module_quantization)
from lily.safetensors_io import bf16_to_float32, float32_to_bf16, write_safetensors
from lily.tiny_tokenizer import TINY_CHAT_TEMPLATE, make_tokenizer_json, tiny_vocab_size

TINY_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "vocab_size": -(-tiny_vocab_size() // 64) * 64,
    "hidden_size": 256, "num_hidden_layers": 8, "full_attention_interval": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False, "attn_output_gate": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [3, 3, 2], "mrope_interleaved": True},
}

# Weight std is gain / sqrt(input width); embeddings have unit std.
_GAINS = {"lm_head": 2.0, "mlp.gate": 2.0, "self_attn.o_proj": 0.5, "linear_attn.out_proj": 0.5,
          "mlp.shared_expert.down_proj": 0.5, "mlp.switch_mlp.down_proj": 0.5}
_SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95}


def _check_quant_args(bits: int, group_size: int, width: int) -> None:
    if bits not in SUPPORTED_BITS or group_size not in SUPPORTED_GROUP_SIZES or width % group_size:
        raise ValueError(f"unsupported quantization: bits {bits}, group_size {group_size}, input width {width}")


def quantize_affine(w: np.ndarray, bits: int = 4, group_size: int = 64) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLX affine quantization of `w` [..., out, in] (float32 math, as mx.quantize; architecture.md §9.3).

    Returns (packed uint32 [..., out, in*bits/32], scales, biases) with scales/biases as BF16 bits
    [..., out, in/group_size]. Per group: the value of larger magnitude is the edge, the scale is
    ±(max-min)/(2^bits-1) nudged so that the edge is an exact multiple of it, the bias is the edge.
    """
    w = np.asarray(w, dtype=np.float32)
    _check_quant_args(bits, group_size, w.shape[-1])
    n_bins = np.float32(2 ** bits - 1)
    g = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    w_max, w_min = g.max(axis=-1, keepdims=True), g.min(axis=-1, keepdims=True)
    mask = np.abs(w_min) > np.abs(w_max)
    scale = np.maximum((w_max - w_min) / n_bins, np.float32(1e-7))
    scale = np.where(mask, scale, -scale)
    edge = np.where(mask, w_min, w_max)
    q0 = np.rint(edge / scale)
    scale = np.where(q0 != 0, edge / np.where(q0 != 0, q0, np.float32(1)), scale)
    bias = np.where(q0 != 0, edge, np.float32(0))
    codes = np.clip(np.rint((g - bias) / scale), 0, n_bins).astype(np.uint32).reshape(w.shape)
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    words = codes.reshape(*w.shape[:-1], w.shape[-1] // per_word, per_word) << shifts
    return np.bitwise_or.reduce(words, axis=-1), float32_to_bf16(scale[..., 0]), float32_to_bf16(bias[..., 0])


def dequantize_affine(packed: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int = 4,
                      group_size: int = 64) -> np.ndarray:
    """w[..., o, j] = scales[..., o, j/group] * q[..., o, j] + biases[..., o, j/group], in float32.

    `scales`/`biases` are BF16 bits (uint16) or floating arrays. Code j of a row sits in word j/(32/bits)
    at bit offset bits*(j mod 32/bits), LSB first.
    """
    per_word = 32 // bits
    _check_quant_args(bits, group_size, packed.shape[-1] * per_word)
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    codes = (packed[..., None] >> shifts) & np.uint32(2 ** bits - 1)
    width = packed.shape[-1] * per_word
    q = codes.reshape(*packed.shape[:-1], width // group_size, group_size).astype(np.float32)
    s, b = (bf16_to_float32(a) if a.dtype == np.uint16 else a.astype(np.float32) for a in (scales, biases))
    return (s[..., None] * q + b[..., None]).reshape(*packed.shape[:-1], width)


def mlx_quantization(config: dict) -> dict:
    """The quantization mlx-lm's converter picks for this model: 4-bit g64, 8-bit router and shared gate."""
    eight_bit = {"bits": 8, "group_size": 64}
    overrides = {f"model.layers.{i}.mlp.{m}": dict(eight_bit)
                 for i in range(config["num_hidden_layers"]) for m in ("gate", "shared_expert_gate")}
    return {"mode": "affine", "bits": 4, "group_size": 64, "overrides": overrides}


def _plan(config: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, kind, shape) of every tensor. Kind 'linear': name is the module, shape the float [..., out, in]."""
    c = config
    H, E, V = c["hidden_size"], c["num_experts"], c["vocab_size"]
    NH, NKV, HD = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    NK, NV, DK, DV = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    I, IS = c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    plan = [("model.embed_tokens", "linear", (V, H)), ("model.norm.weight", "norm", (H,))]
    if not c["tie_word_embeddings"]:
        plan.append(("lm_head", "linear", (V, H)))
    for i, layer_type in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        plan += [(p + "input_layernorm.weight", "norm", (H,)), (p + "post_attention_layernorm.weight", "norm", (H,))]
        if layer_type == "linear_attention":
            a = p + "linear_attn."
            conv_dim = 2 * NK * DK + NV * DV
            plan += [(a + "in_proj_qkv", "linear", (conv_dim, H)), (a + "in_proj_z", "linear", (NV * DV, H)),
                     (a + "in_proj_b", "linear", (NV, H)), (a + "in_proj_a", "linear", (NV, H)),
                     (a + "out_proj", "linear", (H, NV * DV)),
                     (a + "conv1d.weight", "conv", (conv_dim, c["linear_conv_kernel_dim"], 1)),
                     (a + "A_log", "A_log", (NV,)), (a + "dt_bias", "dt_bias", (NV,)),
                     (a + "norm.weight", "norm", (DV,))]
        else:
            a = p + "self_attn."
            plan += [(a + "q_proj", "linear", (2 * NH * HD, H)), (a + "k_proj", "linear", (NKV * HD, H)),
                     (a + "v_proj", "linear", (NKV * HD, H)), (a + "o_proj", "linear", (H, NH * HD)),
                     (a + "q_norm.weight", "norm", (HD,)), (a + "k_norm.weight", "norm", (HD,))]
        m = p + "mlp."
        plan += [(m + "gate", "linear", (E, H)), (m + "shared_expert_gate", "linear", (1, H)),
                 (m + "shared_expert.gate_proj", "linear", (IS, H)), (m + "shared_expert.up_proj", "linear", (IS, H)),
                 (m + "shared_expert.down_proj", "linear", (H, IS)),
                 (m + "switch_mlp.gate_proj", "linear", (E, I, H)), (m + "switch_mlp.up_proj", "linear", (E, I, H)),
                 (m + "switch_mlp.down_proj", "linear", (E, H, I))]
    return plan


def _weight_std(kind: str, width: int) -> float:
    return 1.0 if kind == "model.embed_tokens" else _GAINS.get(kind, 1.0) / math.sqrt(width)


def _unquantized(kind: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norm weights ≈ 1 (stored 1+w), conv taps, A_log (F32) and dt_bias chosen for decays g in about (0.4, 1)."""
    if kind == "norm":
        return float32_to_bf16(1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32))
    if kind == "conv":
        return float32_to_bf16(0.5 * rng.standard_normal(shape, dtype=np.float32))
    if kind == "A_log":
        return np.log(rng.uniform(0.05, 2.0, shape)).astype(np.float32)
    return float32_to_bf16(rng.normal(-1.0, 0.5, shape).astype(np.float32))


def _quantize_gaussian(rng, shape, std, bits, group_size):
    return quantize_affine(std * rng.standard_normal(shape, dtype=np.float32), bits, group_size)


def _random_codes(rng, shape, std, bits, group_size):
    """Uniform random codes with per-group scales/biases giving mean 0 and about `std`; no float weights."""
    *lead, width = shape
    packed = rng.bit_generator.random_raw(math.prod(lead) * width * bits // 64).view(np.uint32)
    n_bins = 2 ** bits - 1
    u = rng.random((*lead, width // group_size), dtype=np.float32) * np.float32(0.8) - np.float32(0.4)
    scale = (u + np.copysign(np.float32(0.8), u)) * np.float32(std * math.sqrt(12.0 / (n_bins * (n_bins + 2))))
    return (packed.reshape(*lead, width * bits // 32), float32_to_bf16(scale),
            float32_to_bf16(scale * np.float32(-n_bins / 2)))


def _build(text_config: dict, seed: int, make_linear, source: str) -> Checkpoint:
    config = config_from_text_config(text_config, source=source)
    tokenizer_json = make_tokenizer_json()
    if config["vocab_size"] < tiny_vocab_size():
        raise ValueError(f"{source}: vocab_size {config['vocab_size']} is smaller than the built-in "
                         f"tokenizer ({tiny_vocab_size()} tokens)")
    quantization, widths = mlx_quantization(config), input_widths(config)
    tensors = {}
    for name, kind, shape in _plan(config):
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if kind != "linear":
            tensors[name] = _unquantized(kind, shape, rng)
            continue
        bits, group_size = module_quantization(quantization, name)
        std = _weight_std(module_kind(name), widths[INPUT_WIDTH[module_kind(name)]])
        for part, a in zip(("weight", "scales", "biases"), make_linear(rng, shape, std, bits, group_size)):
            tensors[f"{name}.{part}"] = a
    ids = {t["content"]: t["id"] for t in json.loads(tokenizer_json)["added_tokens"]}
    generation_config = {**_SAMPLING_DEFAULTS, "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}
    return Checkpoint(None, config, quantization, tensors, {n: source for n in tensors}, generation_config,
                      tokenizer_json, TINY_CHAT_TEMPLATE)


def build_tiny(seed: int = 0, text_config: dict | None = None) -> Checkpoint:
    """The tiny model (TINY_TEXT_CONFIG unless given): Gaussian weights quantized with `quantize_affine`."""
    return _build(text_config or TINY_TEXT_CONFIG, seed, _quantize_gaussian, f"<lily.tiny.build_tiny seed={seed}>")


def build_random(text_config: dict, seed: int = 0) -> Checkpoint:
    """Any geometry (e.g. the full 35B one): random codes/scales/biases drawn directly, fast and memory-light."""
    return _build(text_config, seed, _random_codes, f"<lily.tiny.build_random seed={seed}>")


def write_checkpoint(ckpt: Checkpoint, out_dir: str | Path, max_shard_bytes: int | None = None) -> Path:
    """Writes an mlx-lm style model directory; shards (with an index) when tensors exceed `max_shard_bytes`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a previous write with another shard count
    q = ckpt.quantization
    section = {"group_size": q["group_size"], "bits": q["bits"], "mode": q["mode"],
               **{f"language_model.{m}": v for m, v in q["overrides"].items()}}
    config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": MODEL_TYPE,
              "text_config": ckpt.config, "tie_word_embeddings": ckpt.config["tie_word_embeddings"],
              "quantization": section, "quantization_config": section}
    if "eos_token_id" in ckpt.generation_config:
        config["eos_token_id"] = ckpt.generation_config["eos_token_id"]
    (out / "config.json").write_text(json.dumps(config, indent=4, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(json.dumps(ckpt.generation_config, indent=2) + "\n")

    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(ckpt.tensors):
        nbytes = ckpt.tensors[name].nbytes
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(shards, 1):
        file = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / file, {f"language_model.{n}": ckpt.tensors[n] for n in names},
                          metadata={"format": "mlx"})
        weight_map.update({f"language_model.{n}": file for n in names})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(a.nbytes for a in ckpt.tensors.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
    if ckpt.tokenizer_json is not None:
        (out / "tokenizer.json").write_text(ckpt.tokenizer_json)
        tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                            "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "model_max_length": 262144}
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    if ckpt.chat_template is not None:
        (out / "chat_template.jinja").write_text(ckpt.chat_template)
    return out
