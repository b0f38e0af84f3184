"""Self-checks of the test oracle (tests/oracle.py): converted layout, float32 execution, cache consistency."""

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from lily.tiny_tokenizer import tiny_vocab_size
from oracle import (GEOMETRIES, load_fp32_model, make_checkpoint, mlx_greedy, mlx_logits, mlx_logits_cached,
                    text_config)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle")
    return {name: make_checkpoint(root / name, name, seed=i) for i, name in enumerate(GEOMETRIES)}


def _safetensors_header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _expected_tensors(tc: dict) -> dict[str, tuple[str, tuple]]:
    """Key → (dtype, shape) of the converted checkpoint, from architecture.md §9.2 and §12."""
    h, v = tc["hidden_size"], tc["vocab_size"]
    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    nv = tc["linear_num_value_heads"]
    key_dim = tc["linear_num_key_heads"] * tc["linear_key_head_dim"]
    value_dim = nv * tc["linear_value_head_dim"]
    e, inter, shared = tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
    out = {}

    def quantized(path, shape, bits=4):
        *lead, in_dim = shape
        out[path + ".weight"] = ("U32", (*lead, in_dim * bits // 32))
        out[path + ".scales"] = ("BF16", (*lead, in_dim // 64))
        out[path + ".biases"] = ("BF16", (*lead, in_dim // 64))

    quantized("language_model.model.embed_tokens", (v, h))
    quantized("language_model.lm_head", (v, h))
    out["language_model.model.norm.weight"] = ("BF16", (h,))
    for i in range(tc["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        out[p + "input_layernorm.weight"] = ("BF16", (h,))
        out[p + "post_attention_layernorm.weight"] = ("BF16", (h,))
        quantized(p + "mlp.gate", (e, h), bits=8)
        quantized(p + "mlp.shared_expert_gate", (1, h), bits=8)
        quantized(p + "mlp.shared_expert.gate_proj", (shared, h))
        quantized(p + "mlp.shared_expert.up_proj", (shared, h))
        quantized(p + "mlp.shared_expert.down_proj", (h, shared))
        quantized(p + "mlp.switch_mlp.gate_proj", (e, inter, h))
        quantized(p + "mlp.switch_mlp.up_proj", (e, inter, h))
        quantized(p + "mlp.switch_mlp.down_proj", (e, h, inter))
        if (i + 1) % tc["full_attention_interval"] != 0:
            quantized(p + "linear_attn.in_proj_qkv", (2 * key_dim + value_dim, h))
            quantized(p + "linear_attn.in_proj_z", (value_dim, h))
            quantized(p + "linear_attn.in_proj_b", (nv, h))
            quantized(p + "linear_attn.in_proj_a", (nv, h))
            quantized(p + "linear_attn.out_proj", (h, value_dim))
            out[p + "linear_attn.conv1d.weight"] = ("BF16", (2 * key_dim + value_dim, tc["linear_conv_kernel_dim"], 1))
            out[p + "linear_attn.A_log"] = ("F32", (nv,))
            out[p + "linear_attn.dt_bias"] = ("BF16", (nv,))
            out[p + "linear_attn.norm.weight"] = ("BF16", (tc["linear_value_head_dim"],))
        else:
            quantized(p + "self_attn.q_proj", (2 * nh * hd, h))
            quantized(p + "self_attn.k_proj", (nkv * hd, h))
            quantized(p + "self_attn.v_proj", (nkv * hd, h))
            quantized(p + "self_attn.o_proj", (h, nh * hd))
            out[p + "self_attn.q_norm.weight"] = ("BF16", (hd,))
            out[p + "self_attn.k_norm.weight"] = ("BF16", (hd,))
    return out


def test_geometries_cover_the_required_cases():
    tcs = [text_config(name) for name in GEOMETRIES]
    assert len(tcs) >= 3
    for tc in tcs:
        assert 64 <= tc["hidden_size"] <= 256
        assert tc["vocab_size"] >= tiny_vocab_size()
        assert tc["layer_types"].count("full_attention") >= 2
        assert tc["layer_types"].count("linear_attention") >= 2
        assert tc["num_attention_heads"] > tc["num_key_value_heads"]
        assert tc["num_experts"] >= 8 and tc["num_experts_per_tok"] >= 2
    assert any(tc["head_dim"] != tc["hidden_size"] // tc["num_attention_heads"] for tc in tcs)
    assert any(tc["vocab_size"] % 2 == 1 for tc in tcs)
    ratios = {tc["linear_num_value_heads"] // tc["linear_num_key_heads"] for tc in tcs}
    assert {1, 2} <= ratios


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_converted_layout(checkpoints, name):
    tc = text_config(name)
    ckpt = checkpoints[name]
    header = _safetensors_header(ckpt / "model.safetensors")
    assert header.pop("__metadata__") == {"format": "mlx"}
    got = {k: (t["dtype"], tuple(t["shape"])) for k, t in header.items()}
    expected = _expected_tensors(tc)
    assert sorted(got) == sorted(expected)
    for key, want in expected.items():
        assert got[key] == want, key

    config = json.loads((ckpt / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe"
    for field in ("hidden_size", "num_hidden_layers", "head_dim", "vocab_size", "layer_types"):
        assert config["text_config"][field] == tc[field]
    overrides = {f"language_model.model.layers.{i}.{m}": {"group_size": 64, "bits": 8}
                 for i in range(tc["num_hidden_layers"]) for m in ("mlp.gate", "mlp.shared_expert_gate")}
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine", **overrides}
    assert config["quantization_config"] == config["quantization"]

    generation = json.loads((ckpt / "generation_config.json").read_text())
    added = {t["content"]: t["id"] for t in json.loads((ckpt / "tokenizer.json").read_text())["added_tokens"]}
    assert generation["eos_token_id"] == [added["<|im_end|>"], added["<|endoftext|>"]]
    assert (generation["do_sample"], generation["temperature"], generation["top_k"], generation["top_p"]) == \
        (True, 1.0, 20, 0.95)
    assert (ckpt / "tokenizer_config.json").exists()


def test_norms_were_shifted_by_the_converter(checkpoints):
    weights = mx.load(str(checkpoints["a"] / "model.safetensors"))
    for key in ("language_model.model.norm.weight", "language_model.model.layers.0.input_layernorm.weight",
                "language_model.model.layers.1.self_attn.q_norm.weight",
                "language_model.model.layers.0.linear_attn.norm.weight"):
        w = np.array(weights[key].astype(mx.float32))
        assert abs(w.mean() - 1.0) < 0.05, key
        assert w.std() > 0.05, key


def test_same_seed_same_files_other_seed_other_weights(tmp_path):
    a = make_checkpoint(tmp_path / "a", "b", seed=7)
    b = make_checkpoint(tmp_path / "b", "b", seed=7)
    c = make_checkpoint(tmp_path / "c", "b", seed=8)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_model_runs_in_float32(checkpoints):
    model = load_fp32_model(checkpoints["a"])
    proj = model.language_model.model.layers[0].linear_attn.in_proj_qkv
    x = mx.random.normal((5, text_config("a")["hidden_size"]), key=mx.random.key(11))
    y = proj(x)
    w = mx.dequantize(proj.weight, proj.scales, proj.biases, proj.group_size, proj.bits)
    assert y.dtype == mx.float32 and w.dtype == mx.float32
    np.testing.assert_allclose(np.array(y), np.array(x) @ np.array(w).T, rtol=1e-5, atol=1e-5)

    cache = make_prompt_cache(model)
    logits = model(mx.array([[3, 1, 4, 1, 5]]), cache=cache)
    assert logits.dtype == mx.float32
    gdn, attention = cache[0], cache[1]
    assert {gdn[0].dtype, gdn[1].dtype, attention.keys.dtype, attention.values.dtype} == {mx.float32}


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_cached_chunks_match_full_pass(checkpoints, name):
    rng = np.random.default_rng(100 + sorted(GEOMETRIES).index(name))
    tokens = rng.integers(0, tiny_vocab_size(), 64).tolist()
    cuts = sorted(rng.choice(np.arange(2, 63), 4, replace=False).tolist())
    chunks = [tokens[:1]] + [tokens[a:b] for a, b in zip([1] + cuts, cuts + [64])]
    full = mlx_logits(checkpoints[name], tokens)
    cached = mlx_logits_cached(checkpoints[name], chunks)
    assert full.dtype == np.float32 and full.shape == (64, text_config(name)["vocab_size"])
    assert cached.shape == full.shape
    assert np.abs(cached - full).max() <= 1e-5 * np.abs(full).max()


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_logits_are_not_degenerate(checkpoints, name):
    rng = np.random.default_rng(200 + sorted(GEOMETRIES).index(name))
    logits = mlx_logits(checkpoints[name], rng.integers(0, tiny_vocab_size(), 48).tolist())
    assert np.isfinite(logits).all()
    assert 1.0 < logits.std(axis=-1).min() and np.abs(logits).max() < 50.0
    assert len(set(logits.argmax(axis=-1).tolist())) >= 12


def test_greedy_matches_repeated_full_passes(checkpoints):
    rng = np.random.default_rng(300)
    prompt = rng.integers(0, tiny_vocab_size(), 9).tolist()
    generated = mlx_greedy(checkpoints["b"], prompt, 8)
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(mlx_logits(checkpoints["b"], seq)[-1].argmax()))
    assert generated == seq[len(prompt):]


def test_bad_inputs_raise(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="unknown geometry"):
        text_config("zz")
    with pytest.raises(ValueError, match="moe_intermediate_size = 96"):
        text_config({**GEOMETRIES["a"], "moe_intermediate_size": 96})
    with pytest.raises(ValueError, match="missing fields"):
        text_config({"hidden_size": 64})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ValueError, match="not an empty directory"):
        make_checkpoint(tmp_path / "full")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        mlx_logits(checkpoints["a"], [1, text_config("a")["vocab_size"]])
    with pytest.raises(ValueError, match="empty token list"):
        mlx_logits_cached(checkpoints["a"], [[1, 2], []])


def test_conftest_lists_every_geometry():
    """tests/conftest.py names the geometries without importing mlx (GPU machines run the suite without it)."""
    assert sorted(GEOMETRIES) == ["a", "b", "c"]
