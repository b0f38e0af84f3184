"""Finds, reads and validates a Qwen3.6-35B-A3B MLX checkpoint directory (architecture.md §1, §3.1, §9).

`load_checkpoint` returns a `Checkpoint`: the normalised text config, the quantization section, and every
text-model tensor under its canonical name (the MLX key without the leading `language_model.`, e.g.
`model.layers.0.mlp.gate.weight`, `lm_head.scales`). Tensors are zero-copy views of the mapped shards.
This layer checks files, the config fields and the quantization metadata; the C++ core checks which
tensors the architecture needs and their shapes and dtypes.

Every file is read within limits (regular files only, MAX_JSON_BYTES, JSON nesting, integer sizes up to
INT32_MAX and num_hidden_layers up to MAX_LAYERS), checked before anything is sized from it, and every
problem is a CheckpointError naming the file and the field or tensor.
"""

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import numpy as np

from lily.safetensors_io import CheckpointError, MappedFile, bf16_to_float32, float32_to_bf16, open_regular

MODEL_TYPE = "qwen3_5_moe"
TEXT_MODEL_TYPE = "qwen3_5_moe_text"
SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
# Every integer of the config becomes a C++ int; layers are listed one by one, so their count has a limit of its
# own (llama.cpp's LLAMA_MAX_LAYERS; the core checks the same, csrc/core/config.h).
INT32_MAX = 2**31 - 1
MAX_LAYERS = 512
# config.json, the shard index and generation_config.json are small; a larger one is not one of them.
MAX_JSON_BYTES = 64 << 20
# generation_config.json sampling fields and their JSON types (values are checked by lily.sampling).
_GENERATION_FIELDS = {"temperature": (int, float), "top_k": (int,), "top_p": (int, float), "min_p": (int, float),
                      "repetition_penalty": (int, float), "do_sample": (bool,)}

# Geometry fields that must be present; all positive integers (architecture.md §1).
REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
)
# Optional fields and the values of the release (not HF's class defaults, e.g. max_position_embeddings).
DEFAULTS = {
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "attn_output_gate": True,
    "norm_topk_prob": True, "attention_bias": False, "hidden_act": "silu",
}
ROPE_DEFAULTS = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                 "mrope_section": [11, 11, 10], "mrope_interleaved": True}
# Zero-centred norms, stored as 1+w by MLX and as w by HF (architecture.md §3.1).
SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
# Quantized module (path without `model.layers.N.`) -> the config quantity that is its input width (§9.2).
INPUT_WIDTH = {
    "model.embed_tokens": "hidden_size", "lm_head": "hidden_size",
    "self_attn.q_proj": "hidden_size", "self_attn.k_proj": "hidden_size", "self_attn.v_proj": "hidden_size",
    "self_attn.o_proj": "num_attention_heads*head_dim",
    "linear_attn.in_proj_qkv": "hidden_size", "linear_attn.in_proj_z": "hidden_size",
    "linear_attn.in_proj_b": "hidden_size", "linear_attn.in_proj_a": "hidden_size",
    "linear_attn.out_proj": "value_dim",
    "mlp.gate": "hidden_size", "mlp.shared_expert_gate": "hidden_size",
    "mlp.shared_expert.gate_proj": "hidden_size", "mlp.shared_expert.up_proj": "hidden_size",
    "mlp.shared_expert.down_proj": "shared_expert_intermediate_size",
    "mlp.switch_mlp.gate_proj": "hidden_size", "mlp.switch_mlp.up_proj": "hidden_size",
    "mlp.switch_mlp.down_proj": "moe_intermediate_size",
}
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "merges.txt"]


@dataclass
class Checkpoint:
    model_dir: Path | None             # None for a checkpoint built in memory (lily.tiny)
    config: dict                       # normalised text config (config_from_text_config)
    quantization: dict                 # {"mode", "bits", "group_size", "overrides": {module: {...} | False}}
    tensors: dict[str, np.ndarray]     # canonical name -> array; BF16 as uint16 bits
    files: dict[str, str]              # canonical name -> file it came from (for error messages)
    generation_config: dict            # generation_config.json; eos_token_id always a list
    tokenizer_json: str | None = None  # set only for in-memory checkpoints; else read the model dir
    chat_template: str | None = None
    mapped: list[MappedFile] = field(default_factory=list)  # the shards the tensors are views of


def canonical_name(key: str) -> str | None:
    """MLX or HF tensor/module key -> canonical name, or None for vision-tower and MTP keys (mlx-lm sanitize)."""
    if key.startswith("model.language_model."):
        key = "model." + key[len("model.language_model."):]
    elif key.startswith("language_model."):
        key = key[len("language_model."):]
    if key.startswith(("vision_tower.", "model.visual.", "mtp.", "model.mtp.")):
        return None
    return key


def _bad(source, path: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{source}: {path} {problem}")


def _show(value) -> str:
    """A value from a file for an error message: short, and safe for any nesting depth or size."""
    if isinstance(value, (list, dict)):
        return f"an {'array' if isinstance(value, list) else 'object'} of {len(value)} items"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _positive_int(value, path: str, source, limit: int = INT32_MAX) -> int:
    if type(value) is not int or value <= 0:
        raise _bad(source, path, f"must be a positive integer, got {_show(value)}")
    if value > limit:
        raise _bad(source, path, f"is {_show(value)}, out of range: the limit is {limit}")
    return value


def _positive_number(value, path: str, source) -> float:
    if type(value) not in (int, float) or not value > 0:
        raise _bad(source, path, f"must be a positive number, got {_show(value)}")
    try:
        value = float(value)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value):
        raise _bad(source, path, f"must be a finite positive number, got {_show(value)}")
    return value


def _rope_parameters(d: dict, head_dim: int, source, prefix: str) -> dict:
    """`rope_parameters` (or legacy `rope_scaling` / top-level fields) with `rope_type` spelled out, defaults filled."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    path = prefix + "rope_parameters."
    if not isinstance(rope, dict):
        raise _bad(source, path.rstrip("."), f"must be an object, got {_show(rope)}")
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:  # mlx-lm renames rope_type to type
        rope["rope_type"] = rope.pop("type")
    rope = {**ROPE_DEFAULTS, **{k: d[k] for k in ("rope_theta", "partial_rotary_factor") if k in d}, **rope}
    rope["rope_theta"] = _positive_number(rope["rope_theta"], path + "rope_theta", source)
    factor = rope["partial_rotary_factor"] = _positive_number(rope["partial_rotary_factor"],
                                                              path + "partial_rotary_factor", source)
    if factor > 1 or (head_dim * factor) % 2:
        raise _bad(source, path + "partial_rotary_factor", f"({factor}) times head_dim ({head_dim}) must be an even "
                   "number of dims no larger than head_dim")
    if rope["rope_type"] == "yarn":
        rope["factor"] = _positive_number(rope.get("factor"), path + "factor", source)
        rope["original_max_position_embeddings"] = _positive_int(
            rope.get("original_max_position_embeddings"), path + "original_max_position_embeddings", source)
    elif rope["rope_type"] != "default":
        raise _bad(source, path + "rope_type", f"is {_show(rope['rope_type'])}; Lily supports 'default' and 'yarn'")
    return rope


def config_from_text_config(d: dict, source="config.json", prefix: str = "") -> dict:
    """Validates an HF-style text config and returns it normalised, with defaults filled in.

    `prefix` is prepended to field names in error messages (the loader passes "text_config.").
    """
    if d.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
        raise _bad(source, prefix + "model_type", f"must be '{TEXT_MODEL_TYPE}', got {_show(d['model_type'])}")
    cfg: dict = {"model_type": TEXT_MODEL_TYPE}
    for key in REQUIRED_FIELDS:
        if key not in d:
            raise _bad(source, prefix + key, "is missing (required)")
        cfg[key] = _positive_int(d[key], prefix + key, source, MAX_LAYERS if key == "num_hidden_layers" else INT32_MAX)
    merged = {**DEFAULTS, **{k: d[k] for k in DEFAULTS if k in d}}
    for key in ("linear_conv_kernel_dim", "full_attention_interval", "max_position_embeddings"):
        cfg[key] = _positive_int(merged[key], prefix + key, source)
    cfg["rms_norm_eps"] = _positive_number(merged["rms_norm_eps"], prefix + "rms_norm_eps", source)
    for key in ("tie_word_embeddings", "attn_output_gate", "norm_topk_prob", "attention_bias"):
        if type(merged[key]) is not bool:
            raise _bad(source, prefix + key, f"must be true or false, got {_show(merged[key])}")
    for key, supported in (("hidden_act", "silu"), ("attn_output_gate", True), ("attention_bias", False)):
        if merged[key] != supported:
            raise _bad(source, prefix + key, f"is {_show(merged[key])}; Lily supports only {supported!r}")
    cfg.update({k: merged[k] for k in ("tie_word_embeddings", "attn_output_gate", "norm_topk_prob",
                                       "attention_bias", "hidden_act")})

    pairs = (("num_attention_heads", "num_key_value_heads"), ("linear_num_value_heads", "linear_num_key_heads"))
    for big, small in pairs:
        if cfg[big] % cfg[small]:
            raise _bad(source, prefix + big, f"({cfg[big]}) must be divisible by {prefix}{small} ({cfg[small]})")
    if cfg["num_experts_per_tok"] > cfg["num_experts"]:
        raise _bad(source, prefix + "num_experts_per_tok", f"({cfg['num_experts_per_tok']}) exceeds "
                   f"{prefix}num_experts ({cfg['num_experts']})")

    interval = cfg["full_attention_interval"]
    cfg["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                          for i in range(cfg["num_hidden_layers"])]
    if d.get("layer_types", cfg["layer_types"]) != cfg["layer_types"]:
        raise _bad(source, prefix + "layer_types", f"must follow full_attention_interval {interval} "
                   "(layer i is full attention iff (i+1) % interval == 0)")
    cfg["rope_parameters"] = rope = _rope_parameters(d, cfg["head_dim"], source, prefix)
    cfg["rope_theta"], cfg["partial_rotary_factor"] = rope["rope_theta"], rope["partial_rotary_factor"]
    return cfg


def input_widths(config: dict) -> dict[str, int]:
    """The input widths of quantized modules, by the names used in INPUT_WIDTH."""
    return {
        "hidden_size": config["hidden_size"],
        "num_attention_heads*head_dim": config["num_attention_heads"] * config["head_dim"],
        "value_dim": config["linear_num_value_heads"] * config["linear_value_head_dim"],
        "moe_intermediate_size": config["moe_intermediate_size"],
        "shared_expert_intermediate_size": config["shared_expert_intermediate_size"],
    }


def module_kind(module: str) -> str | None:
    """`model.layers.3.self_attn.o_proj` -> `self_attn.o_proj`; None if not a quantizable module of the model."""
    kind = re.sub(r"^model\.layers\.\d+\.", "", module)
    return kind if kind in INPUT_WIDTH else None


def module_quantization(quantization: dict, module: str) -> tuple[int, int] | None:
    """(bits, group_size) configured for a canonical module path, or None if it is configured unquantized."""
    params = quantization["overrides"].get(module, {"bits": quantization["bits"],
                                                     "group_size": quantization["group_size"]})
    return None if params is False else (params["bits"], params["group_size"])


def _quant_params(q: dict, path: str, source, defaults: dict) -> dict:
    if q.get("mode", "affine") != "affine":
        raise _bad(source, path + "mode", f"is {_show(q['mode'])}; Lily supports only 'affine'")
    params = {key: q.get(key, defaults.get(key)) for key in ("bits", "group_size")}
    for key, supported in (("bits", SUPPORTED_BITS), ("group_size", SUPPORTED_GROUP_SIZES)):
        if type(params[key]) is not int or params[key] not in supported:
            raise _bad(source, path + key, f"is {_show(params[key])}; supported: {', '.join(map(str, supported))}")
    return params


def quantization_from_config(raw: dict, config: dict, source="config.json") -> dict:
    """The top-level `quantization` (or `quantization_config`) section, normalised, with canonical override keys."""
    name = "quantization" if "quantization" in raw else "quantization_config"
    q = raw.get(name)
    if q is None:
        raise _bad(source, "quantization", "is missing: Lily runs MLX affine-quantized checkpoints "
                   "(convert with `mlx_lm.convert -q`)")
    if not isinstance(q, dict) or "quant_method" in q:
        raise _bad(source, name, "is not an MLX quantization section" +
                   (f" (quant_method {_show(q['quant_method'])})" if isinstance(q, dict) else f": {_show(q)}"))
    out = {"mode": "affine", **_quant_params(q, name + ".", source, {}), "overrides": {}}
    widths = input_widths(config)
    for key, value in q.items():
        module = canonical_name(key)
        if module is None or (not isinstance(value, dict) and value is not False):
            continue
        path = f"{name}.{key}"
        params = False if value is False else _quant_params(value, path + ".", source, out)
        kind = module_kind(module)
        if params and kind and widths[INPUT_WIDTH[kind]] % params["group_size"]:
            raise _bad(source, path + ".group_size", f"({params['group_size']}) does not divide the module's input "
                       f"width {INPUT_WIDTH[kind]} = {widths[INPUT_WIDTH[kind]]}")
        out["overrides"][module] = params
    for label, width in widths.items():
        if width % out["group_size"]:
            raise _bad(source, name + ".group_size", f"({out['group_size']}) does not divide {label} ({width})")
    return out


def _describe(a: np.ndarray | None) -> str:
    return "missing" if a is None else f"{a.dtype} {list(a.shape)}"


def check_quantized_tensors(ckpt: Checkpoint) -> None:
    """Derives (bits, group_size) of every quantized module from its shapes and checks them against the config.

    Modules the model does not have are skipped: the core ignores them.
    """
    t, widths = ckpt.tensors, input_widths(ckpt.config)
    for name in sorted(n for n in t if n.endswith(".weight") and module_kind(n[:-len(".weight")])):
        module, w = name[:-len(".weight")], t[name]
        s, b = t.get(module + ".scales"), t.get(module + ".biases")
        configured = module_quantization(ckpt.quantization, module)
        want = "unquantized" if configured is None else f"bits {configured[0]}, group_size {configured[1]}"
        where = f"{ckpt.files[name]}: tensor '{name}'"
        if w.dtype != np.uint32 and s is None and b is None:
            if configured is not None:
                raise CheckpointError(f"{where} is stored unquantized ({w.dtype}), but config.json quantization "
                                      f"says {want}")
            continue
        if (s is None or b is None or w.dtype != np.uint32 or s.dtype != np.uint16 or b.dtype != np.uint16
                or w.ndim < 2 or s.shape != b.shape or s.shape[:-1] != w.shape[:-1]):
            raise CheckpointError(f"{where}: not a quantized triplet: weight {_describe(w)}, scales {_describe(s)}, "
                                  f"biases {_describe(b)} (expected U32 [..., out, in*bits/32] and BF16 "
                                  "[..., out, in/group_size])")
        label = INPUT_WIDTH[module_kind(module)]
        width = widths[label]
        bits, group = 32 * w.shape[-1] / width, width / s.shape[-1]
        derived = (int(bits), int(group)) if bits.is_integer() and group.is_integer() else None
        if derived != configured:
            raise CheckpointError(f"{where}: shapes weight {list(w.shape)} / scales {list(s.shape)} with input "
                                  f"width {width} ({label}) give bits {bits:g}, group_size {group:g}, but "
                                  f"config.json quantization says {want}")


def _read_json(path: Path) -> dict:
    with open_regular(path) as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: larger than the limit of {MAX_JSON_BYTES} bytes for a JSON file")
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON (nested too deeply)") from None
    except ValueError as e:  # not UTF-8, not JSON, or an integer past Python's digit limit
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: must contain a JSON object")
    return value


def _read_tensors(model_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, str], list[MappedFile]]:
    """All text-model tensors of the directory by canonical name, the file each came from, and the mapped files."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.exists() or index_path.is_symlink():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: 'weight_map' must map tensor names to shard file names")
        shards: dict[str, list[str]] = {}
        for key, shard in weight_map.items():
            parts = PurePosixPath(shard).parts
            if not parts or shard.startswith("/") or ".." in parts or "\\" in shard:
                raise CheckpointError(f"{index_path}: shard {_show(shard)} (holding {_show(key)}) is not a file "
                                      "name inside the model directory")
            shards.setdefault(shard, []).append(key)
    else:
        paths = sorted(model_dir.glob("model*.safetensors"))
        if not paths:
            raise CheckpointError(f"{model_dir}: no model.safetensors, model-*.safetensors or "
                                  "model.safetensors.index.json")
        shards = {p.name: None for p in paths}
    tensors, files, mapped = {}, {}, []
    for shard, keys in shards.items():
        path = model_dir / shard
        if keys is not None and not (path.exists() or path.is_symlink()):
            raise CheckpointError(f"{index_path}: shard '{shard}' (holding '{keys[0]}') does not exist in {model_dir}")
        mapped.append(MappedFile(path))
        data = mapped[-1].tensors
        for key in keys if keys is not None else data:
            if key not in data:
                raise CheckpointError(f"{path}: tensor '{key}' is listed in {index_path.name} but not in this shard")
            name = canonical_name(key)
            if name is None:
                continue
            if name in tensors:
                raise CheckpointError(f"{path}: tensor '{key}' duplicates '{name}' from {files[name]}")
            tensors[name], files[name] = data[key], str(path)
    return tensors, files, mapped


def _apply_hf_layout(tensors: dict[str, np.ndarray]) -> None:
    """HF-layout weights (conv1d [C,1,K]): conv1d -> [C,K,1] and zero-centred norms -> 1+w (§3.1)."""
    if not any(n.endswith("conv1d.weight") and a.shape[-1] != 1 for n, a in tensors.items()):
        return
    for name, a in tensors.items():
        if name.endswith("conv1d.weight") and a.ndim == 3 and a.shape[-1] != 1:
            tensors[name] = np.ascontiguousarray(np.moveaxis(a, 2, 1))
        elif name.endswith(SHIFTED_NORMS) and a.ndim == 1:
            tensors[name] = (float32_to_bf16(bf16_to_float32(a) + 1.0) if a.dtype == np.uint16
                             else (a + 1.0).astype(a.dtype))


def _generation_config(path: Path) -> dict:
    """generation_config.json, checked: eos_token_id ids, and sampling defaults that SamplingParams accepts (so
    that a bad value fails here, naming the file and field, not at every generation)."""
    from lily.sampling import SamplingParams

    if not (path.exists() or path.is_symlink()):
        return {}
    gen = _read_json(path)
    eos = gen.get("eos_token_id")
    if eos is not None:
        eos = [eos] if type(eos) is int else eos
        if not isinstance(eos, list) or not all(type(e) is int and 0 <= e <= INT32_MAX for e in eos):
            raise CheckpointError(f"{path}: eos_token_id must be a token id or a list of token ids, "
                                  f"got {_show(gen['eos_token_id'])}")
        gen["eos_token_id"] = eos
    new_tokens = gen.get("max_new_tokens")
    if new_tokens is not None and (type(new_tokens) is not int or not 1 <= new_tokens <= INT32_MAX):
        raise CheckpointError(f"{path}: max_new_tokens must be an integer in [1, {INT32_MAX}], got {_show(new_tokens)}")
    for key, kinds in _GENERATION_FIELDS.items():
        value = gen.get(key)
        if value is not None and (type(value) not in kinds):
            wanted = {(bool,): "true or false", (int,): "an integer"}.get(kinds, "a number")
            raise CheckpointError(f"{path}: {key} must be {wanted}, got {_show(value)}")
    try:
        SamplingParams.from_generation_config(gen)
    except (ValueError, TypeError, OverflowError) as e:
        raise CheckpointError(f"{path}: {str(e).replace('SamplingParams.', '')}") from None
    return gen


def resolve_model_path(path_or_id: str | Path, revision: str | None = None) -> Path:
    """A local model directory as is; else a Hugging Face repo id (`org/name`), downloaded to the HF cache."""
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    text = str(path_or_id)
    if path.exists() or not re.fullmatch(r"[A-Za-z0-9_][\w.-]*/[\w.-]+", text):
        raise FileNotFoundError(f"{text}: not a model directory, and not a Hugging Face repo id (org/name)")
    return _download(text, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    """The hub repo's files in the Hugging Face cache (huggingface_hub's progress bars show a download). Every
    failure is one FileNotFoundError line naming the id, the cache searched and how to use a local directory."""
    from huggingface_hub import constants, errors, snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_PATTERNS))
    except errors.GatedRepoError:
        why = (f"access to it is gated: accept its terms at https://huggingface.co/{repo_id} and log in "
               "(`hf auth login`)")
    except errors.RepositoryNotFoundError:
        why = "there is no such model on the Hugging Face hub (or it is private: log in with `hf auth login`)"
    except errors.RevisionNotFoundError:
        why = f"the hub has no revision {revision!r} of it"
    except errors.LocalEntryNotFoundError as e:  # not in the cache, and the hub could not be asked
        offline = getattr(constants, "HF_HUB_OFFLINE", False) or \
            os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
        why = (f"it is not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and "
               + ("HF_HUB_OFFLINE is set, so it was not downloaded" if offline
                  else f"the hub could not be reached ({_root_cause(e)})"))
    except errors.HfHubHTTPError as e:
        why = f"the Hugging Face hub refused the download ({_root_cause(e)})"
    raise FileNotFoundError(f"{repo_id}: {why}; to run a model from a local directory, pass its path instead "
                            "(lily.load('/path/to/model'), lily … --model /path/to/model)") from None


def _root_cause(e: BaseException) -> str:
    """The innermost cause of an exception, on one line (e.g. "ConnectError: [Errno 111] Connection refused")."""
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.startswith("Got: "):  # huggingface_hub's wrapper of the network error
        return text[len("Got: "):]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def load_checkpoint(path_or_id: str | Path, revision: str | None = None) -> Checkpoint:
    """Reads and validates a checkpoint directory (or hub repo id); raises CheckpointError naming what is wrong."""
    model_dir = resolve_model_path(path_or_id, revision)
    config_path = model_dir / "config.json"
    raw = _read_json(config_path)
    model_type = raw.get("model_type")
    if model_type == MODEL_TYPE:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise _bad(config_path, "text_config", "is missing or not an object")
        if "tie_word_embeddings" in raw and "tie_word_embeddings" not in text:
            text = {**text, "tie_word_embeddings": raw["tie_word_embeddings"]}
        config = config_from_text_config(text, config_path, "text_config.")
    elif model_type == TEXT_MODEL_TYPE:
        config = config_from_text_config(raw, config_path)
    else:
        raise CheckpointError(f"{config_path}: unsupported model_type {_show(model_type)} (Lily runs {MODEL_TYPE} only)")
    quantization = quantization_from_config(raw, config, config_path)
    generation_config = _generation_config(model_dir / "generation_config.json")
    tensors, files, mapped = _read_tensors(model_dir)
    _apply_hf_layout(tensors)
    if config["tie_word_embeddings"]:
        tensors = {n: a for n, a in tensors.items() if not n.startswith("lm_head.")}
    ckpt = Checkpoint(model_dir, config, quantization, tensors, files, generation_config, mapped=mapped)
    check_quantized_tensors(ckpt)
    return ckpt
