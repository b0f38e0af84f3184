"""Test oracle: tiny random `qwen3_5_moe` checkpoints converted by mlx-lm, and mlx-lm's float32 outputs.

`make_checkpoint` writes a random checkpoint in the Hugging Face layout of the BF16 release
(architecture.md §9.1) and converts it with mlx-lm's own converter (`mlx_lm.convert.convert`, 4-bit,
group 64; the model's quant_predicate makes the router and the shared-expert gate 8-bit). The result
has the layout of the real MLX 4-bit checkpoint (§9.2, §12) at a tiny geometry.

`mlx_logits`, `mlx_logits_cached` and `mlx_greedy` run mlx-lm on such a checkpoint with every floating
parameter (quantization scales and biases, norms, conv, A_log, dt_bias) cast to float32, so activations,
caches and the quantized matmuls are float32 too. This is a helper module, not a test file.
"""

import contextlib
import functools
import io
import json
import math
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.convert import convert
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from lily.tiny_tokenizer import make_tokenizer_json, tiny_vocab_size

# Fields of the real Qwen3.6-35B-A3B text_config (architecture.md §1) that the geometries do not change.
BASE_TEXT_CONFIG: dict = {
    "model_type": "qwen3_5_moe_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "dtype": "bfloat16",
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "rms_norm_eps": 1e-6,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    "use_cache": True,
}

# The geometry fields every checkpoint must set. Derived fields (layer_types, rope_parameters, token
# ids) are filled in by `text_config`.
GEOMETRY_FIELDS = (
    "hidden_size", "num_hidden_layers", "full_attention_interval", "num_attention_heads",
    "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size",
)

GEOMETRIES: dict[str, dict] = {
    # Attention and GDN alternate; head_dim 64 != 128/4; GQA 4:2; value heads = 2 x key heads.
    "a": {
        "hidden_size": 128, "num_hidden_layers": 4, "full_attention_interval": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
        "vocab_size": 491,
    },
    # The real layer pattern (3 GDN, then 1 attention) twice; head_dim 32 != 64/4; GQA 4:1;
    # value heads = key heads; 16 experts, top-4; shared expert wider than the routed ones.
    "b": {
        "hidden_size": 64, "num_hidden_layers": 8, "full_attention_interval": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 2,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32,
        "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128,
        "vocab_size": 503,
    },
    # Widest: head_dim = hidden / heads; GQA 8:2; GDN key head dim 32 != value head dim 64 (catches
    # swapped state axes); 12 experts, top-3; an even vocabulary like the real one.
    "c": {
        "hidden_size": 256, "num_hidden_layers": 4, "full_attention_interval": 2,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8,
        "linear_key_head_dim": 32, "linear_value_head_dim": 64,
        "num_experts": 12, "num_experts_per_tok": 3,
        "moe_intermediate_size": 128, "shared_expert_intermediate_size": 64,
        "vocab_size": 512,
    },
}

GROUP_SIZE = 64
ROPE_THETA = 10_000_000
PARTIAL_ROTARY_FACTOR = 0.25


@functools.lru_cache(maxsize=1)
def _tokenizer() -> tuple[str, dict[str, int]]:
    """The tiny tokenizer's JSON text and the ids of its added tokens."""
    text = make_tokenizer_json()
    return text, {t["content"]: t["id"] for t in json.loads(text)["added_tokens"]}


def text_config(geometry: str | dict) -> dict:
    """The full `text_config` for a geometry name of GEOMETRIES or a dict with every GEOMETRY_FIELDS key."""
    if isinstance(geometry, str):
        if geometry not in GEOMETRIES:
            raise ValueError(f"unknown geometry {geometry!r}; known: {sorted(GEOMETRIES)}")
        name, g = f"geometry {geometry!r}", dict(GEOMETRIES[geometry])
    else:
        name, g = "custom geometry", dict(geometry)
    missing = [f for f in GEOMETRY_FIELDS if f not in g]
    unknown = [f for f in g if f not in GEOMETRY_FIELDS]
    if missing or unknown:
        raise ValueError(f"{name}: missing fields {missing}, unknown fields {unknown}")

    quantized_inputs = {
        "hidden_size": g["hidden_size"],
        "linear value dim (out_proj input)": g["linear_num_value_heads"] * g["linear_value_head_dim"],
        "attention output dim (o_proj input)": g["num_attention_heads"] * g["head_dim"],
        "moe_intermediate_size": g["moe_intermediate_size"],
        "shared_expert_intermediate_size": g["shared_expert_intermediate_size"],
    }
    for field, dim in quantized_inputs.items():
        if dim % GROUP_SIZE != 0:
            raise ValueError(f"{name}: {field} = {dim} is not a multiple of {GROUP_SIZE}, so mlx-lm "
                             "would leave that matrix unquantized")
    if g["vocab_size"] < tiny_vocab_size():
        raise ValueError(f"{name}: vocab_size {g['vocab_size']} is smaller than the tiny tokenizer "
                         f"({tiny_vocab_size()} tokens)")
    if g["linear_num_value_heads"] % g["linear_num_key_heads"] != 0:
        raise ValueError(f"{name}: linear_num_value_heads is not a multiple of linear_num_key_heads")
    if g["num_attention_heads"] % g["num_key_value_heads"] != 0:
        raise ValueError(f"{name}: num_attention_heads is not a multiple of num_key_value_heads")
    if g["num_experts_per_tok"] > g["num_experts"]:
        raise ValueError(f"{name}: num_experts_per_tok exceeds num_experts")
    rotary_dim = g["head_dim"] * PARTIAL_ROTARY_FACTOR
    if rotary_dim != int(rotary_dim) or int(rotary_dim) % 2 != 0:
        raise ValueError(f"{name}: head_dim {g['head_dim']} gives rotary dim {rotary_dim}, which is not even")

    # mRoPE sections over the rotary frequencies, split like the real [11, 11, 10] of 32 (unused for text).
    n_freq = int(rotary_dim) // 2
    t_sec = math.ceil(n_freq / 3)
    h_sec = math.ceil((n_freq - t_sec) / 2)
    interval = g["full_attention_interval"]
    ids = _tokenizer()[1]
    return {
        **BASE_TEXT_CONFIG,
        **g,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(g["num_hidden_layers"])],
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [t_sec, h_sec, n_freq - t_sec - h_sec],
            "rope_type": "default",
            "rope_theta": ROPE_THETA,
            "partial_rotary_factor": PARTIAL_ROTARY_FACTOR,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|endoftext|>"],
    }


def _hf_weights(tc: dict, rng: np.random.Generator) -> dict[str, mx.array]:
    """Random weights under the HF release's key names (§9.1): bf16, except A_log in f32.

    Matrices are N(0, 1/fan_in) so every block adds an O(1) update to the residual stream; lm_head is
    scaled so that logits have a standard deviation near 3. Plain norms are zero-centred (HF flavour,
    the converter adds 1); the gated GDN norm is stored as is, near 1.
    """
    h, v = tc["hidden_size"], tc["vocab_size"]
    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    nk, nv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    key_dim, value_dim = nk * tc["linear_key_head_dim"], nv * tc["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    e, inter, shared = tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]

    def normal(shape, std):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)

    def linear(out_dim, in_dim, gain=1.0):
        return normal((out_dim, in_dim), gain / math.sqrt(in_dim))

    def norm(dim):
        return normal((dim,), 0.1)

    w = {"model.language_model.embed_tokens.weight": normal((v, h), 1.0),
         "model.language_model.norm.weight": norm(h),
         "lm_head.weight": linear(v, h, gain=3.0)}
    for i, layer_type in enumerate(tc["layer_types"]):
        p = f"model.language_model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        if layer_type == "linear_attention":
            w[p + "linear_attn.in_proj_qkv.weight"] = linear(conv_dim, h)
            w[p + "linear_attn.in_proj_z.weight"] = linear(value_dim, h)
            w[p + "linear_attn.in_proj_b.weight"] = linear(nv, h)
            w[p + "linear_attn.in_proj_a.weight"] = linear(nv, h)
            w[p + "linear_attn.conv1d.weight"] = normal((conv_dim, 1, tc["linear_conv_kernel_dim"]), 0.5)
            # Decay g = exp(-A·softplus(a + dt_bias)) mostly in 0.4..1, so the state carries memory.
            w[p + "linear_attn.A_log"] = np.log(rng.uniform(0.05, 1.0, nv)).astype(np.float32)
            w[p + "linear_attn.dt_bias"] = normal((nv,), 0.5) - 1.0
            w[p + "linear_attn.norm.weight"] = 1.0 + norm(tc["linear_value_head_dim"])
            w[p + "linear_attn.out_proj.weight"] = linear(h, value_dim)
        else:
            w[p + "self_attn.q_proj.weight"] = linear(2 * nh * hd, h)
            w[p + "self_attn.k_proj.weight"] = linear(nkv * hd, h)
            w[p + "self_attn.v_proj.weight"] = linear(nkv * hd, h)
            w[p + "self_attn.o_proj.weight"] = linear(h, nh * hd)
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "mlp.gate.weight"] = linear(e, h, gain=2.0)
        w[p + "mlp.experts.gate_up_proj"] = normal((e, 2 * inter, h), 1 / math.sqrt(h))
        w[p + "mlp.experts.down_proj"] = normal((e, h, inter), 1 / math.sqrt(inter))
        w[p + "mlp.shared_expert.gate_proj.weight"] = linear(shared, h)
        w[p + "mlp.shared_expert.up_proj.weight"] = linear(shared, h)
        w[p + "mlp.shared_expert.down_proj.weight"] = linear(h, shared)
        w[p + "mlp.shared_expert_gate.weight"] = linear(1, h)
    return {k: mx.array(a) if k.endswith("A_log") else mx.array(a).astype(mx.bfloat16) for k, a in w.items()}


def _write_hf_checkpoint(src: Path, tc: dict, seed: int) -> None:
    ids = _tokenizer()[1]
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": tc,
        "tie_word_embeddings": False,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    (src / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(src / "model.safetensors"), _hf_weights(tc, np.random.default_rng(seed)))
    (src / "tokenizer.json").write_text(_tokenizer()[0])
    (src / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen3_5Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 262144,
    }, indent=2))
    (src / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }, indent=2))


def make_checkpoint(out_dir: Path, geometry: str | dict = "a", seed: int = 0) -> Path:
    """Write a random tiny checkpoint and convert it with mlx-lm (4-bit, group 64) into `out_dir`.

    `geometry` is a name of GEOMETRIES or a dict with every GEOMETRY_FIELDS key. `out_dir` must not exist
    or be empty. The same geometry and seed give the same files. Returns `out_dir`.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        if not out_dir.is_dir() or any(out_dir.iterdir()):
            raise ValueError(f"make_checkpoint: {out_dir} exists and is not an empty directory")
        out_dir.rmdir()  # mlx-lm's convert refuses an existing destination
    tc = text_config(geometry)
    with tempfile.TemporaryDirectory(prefix="lily-hf-") as tmp:
        src = Path(tmp)
        _write_hf_checkpoint(src, tc, seed)
        with contextlib.redirect_stdout(io.StringIO()):
            convert(str(src), str(out_dir), quantize=True, q_group_size=GROUP_SIZE, q_bits=4)
    return out_dir


@functools.lru_cache(maxsize=8)
def _load_fp32(model_dir: str, weights_stamp: tuple):
    """The mlx-lm model of `model_dir` with every floating parameter in float32.

    `weights_stamp` (size and mtime of the weights) is only part of the cache key, so a checkpoint
    rewritten in the same directory is loaded again.
    """
    model, _ = load_model(Path(model_dir))
    model.set_dtype(mx.float32)
    dtypes = {a.dtype for _, a in tree_flatten(model.parameters())}
    left = dtypes - {mx.float32, mx.uint32}
    if left:
        raise RuntimeError(f"{model_dir}: parameters still in {left} after the float32 cast")
    mx.eval(model.parameters())
    return model


def load_fp32_model(model_dir: Path):
    """The cached float32 mlx-lm model of a converted checkpoint directory."""
    model_dir = Path(model_dir).resolve()
    weights = sorted(model_dir.glob("model*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{model_dir}: no model*.safetensors (not a converted checkpoint)")
    stamp = tuple((w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights)
    return _load_fp32(str(model_dir), stamp)


def _check_tokens(model, tokens: list[int], what: str) -> None:
    vocab = model.language_model.args.vocab_size
    if len(tokens) == 0:
        raise ValueError(f"{what}: empty token list")
    bad = [t for t in tokens if not 0 <= int(t) < vocab]
    if bad:
        raise ValueError(f"{what}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")


def mlx_logits(model_dir: Path, tokens: list[int]) -> np.ndarray:
    """Float32 logits [T, vocab] of one full-sequence mlx-lm pass (no cache) over `tokens`."""
    model = load_fp32_model(model_dir)
    _check_tokens(model, tokens, "mlx_logits")
    return np.array(model(mx.array([tokens], dtype=mx.int32))[0])


def mlx_logits_cached(model_dir: Path, chunks: list[list[int]]) -> np.ndarray:
    """Float32 logits [sum of chunk lengths, vocab]: the chunks are fed in order through mlx-lm's cache."""
    model = load_fp32_model(model_dir)
    if not chunks:
        raise ValueError("mlx_logits_cached: no chunks")
    cache = make_prompt_cache(model)
    out = []
    for i, chunk in enumerate(chunks):
        _check_tokens(model, chunk, f"mlx_logits_cached chunk {i}")
        out.append(np.array(model(mx.array([chunk], dtype=mx.int32), cache=cache)[0]))
    return np.concatenate(out, axis=0)


def mlx_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` from mlx-lm's own generation loop (cache, one token per step).

    It does not stop at an end-of-sequence token: exactly `n` tokens come back.
    """
    model = load_fp32_model(model_dir)
    _check_tokens(model, prompt, "mlx_greedy prompt")
    if n < 1:
        raise ValueError(f"mlx_greedy: n must be >= 1, got {n}")
    steps = generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=n,
                          sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
    return [int(token) for token, _ in steps]
