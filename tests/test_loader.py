"""Checkpoint I/O: safetensors reader/writer, MLX affine quantization, tiny checkpoints, load_checkpoint errors."""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from lily.loader import CheckpointError, canonical_name, load_checkpoint, resolve_model_path
from lily.safetensors_io import bf16_to_float32, float32_to_bf16, read_safetensors, write_safetensors
from lily.tiny import (TINY_TEXT_CONFIG, build_random, build_tiny, dequantize_affine, quantize_affine,
                       write_checkpoint)

QUANTIZED = ("weight", "scales", "biases")
MOE = [f"mlp.{m}.{p}" for m in ("gate", "shared_expert_gate", "shared_expert.gate_proj", "shared_expert.up_proj",
                                "shared_expert.down_proj", "switch_mlp.gate_proj", "switch_mlp.up_proj",
                                "switch_mlp.down_proj") for p in QUANTIZED]
GDN = ([f"linear_attn.{m}.{p}" for m in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
        for p in QUANTIZED] + ["linear_attn.conv1d.weight", "linear_attn.A_log", "linear_attn.dt_bias",
                               "linear_attn.norm.weight"])
ATTN = ([f"self_attn.{m}.{p}" for m in ("q_proj", "k_proj", "v_proj", "o_proj") for p in QUANTIZED]
        + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"])


def expected_keys(n_layers: int, interval: int) -> set[str]:
    """The canonical key set of architecture.md §12: 7 global keys, 45 per GDN layer, 40 per attention layer."""
    keys = {f"{m}.{p}" for m in ("lm_head", "model.embed_tokens") for p in QUANTIZED} | {"model.norm.weight"}
    for i in range(n_layers):
        mixer = ATTN if (i + 1) % interval == 0 else GDN
        keys |= {f"model.layers.{i}.{k}" for k in ["input_layernorm.weight", "post_attention_layernorm.weight",
                                                   *MOE, *mixer]}
    return keys


def is_quantized(name: str, tensors: dict) -> bool:
    """Part of a quantized triplet (`X.weight` / `X.scales` / `X.biases`)."""
    return name.rsplit(".", 1)[0] + ".scales" in tensors


def assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert np.array_equal(a[name], b[name]), name


def rewrite_shard(path: Path, edit) -> None:
    """Reads a shard into memory, applies `edit(dict)` and writes it back as safetensors."""
    tensors = {k: np.array(v) for k, v in read_safetensors(path).items()}
    edit(tensors)
    write_safetensors(path, tensors, metadata={"format": "mlx"})


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def shard_of(model_dir: Path, key: str) -> Path:
    return model_dir / json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"][key]


@pytest.fixture(scope="module")
def tiny():
    return build_tiny(seed=11)


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    return write_checkpoint(tiny, tmp_path_factory.mktemp("tiny"), max_shard_bytes=2 << 20)


@pytest.fixture
def ckpt_dir(tiny_dir, tmp_path):
    """A private copy of the sharded tiny checkpoint, free to corrupt."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


# --- safetensors ---------------------------------------------------------------------------------------------

def test_safetensors_round_trip_and_interop(tmp_path):
    rng = np.random.default_rng(1)
    tensors = {"u8": rng.integers(0, 255, 7, dtype=np.uint8),
               "f32": rng.standard_normal((3, 5), dtype=np.float32),
               "bf16": float32_to_bf16(rng.standard_normal((4, 6), dtype=np.float32)),
               "u32": rng.integers(0, 2**32, (2, 3, 4), dtype=np.uint32),
               "i64": rng.integers(-9, 9, (0, 3)), "f16": rng.standard_normal(9).astype(np.float16)}
    path = tmp_path / "t.safetensors"
    write_safetensors(path, tensors, metadata={"format": "mlx"})
    assert (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 8 == 0
    back = read_safetensors(path)
    assert_same_tensors(back, tensors)
    assert all(not a.flags.writeable and a.flags.aligned for a in back.values())  # zero-copy views of the map
    import mlx.core as mx
    loaded = mx.load(str(path))
    assert loaded["bf16"].dtype == mx.bfloat16
    assert np.array_equal(np.array(loaded["bf16"].view(mx.uint16)), tensors["bf16"])
    from safetensors.numpy import save_file
    save_file({"a": tensors["f32"], "b": tensors["u8"]}, str(tmp_path / "other.safetensors"))
    assert_same_tensors(read_safetensors(tmp_path / "other.safetensors"), {"a": tensors["f32"], "b": tensors["u8"]})


def test_bf16_conversion_matches_mlx():
    import mlx.core as mx
    x = np.random.default_rng(2).standard_normal(10_000, dtype=np.float32) * 100
    bits = float32_to_bf16(x)
    assert np.array_equal(bits, np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16)))
    assert np.array_equal(float32_to_bf16(bf16_to_float32(bits)), bits)


def raw_safetensors(path: Path, header: dict | bytes, data: bytes = b"", length: int | None = None) -> Path:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return path


def test_misaligned_tensor_is_copied(tmp_path):
    values = np.random.default_rng(3).standard_normal(4, dtype=np.float32)
    header = {"b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "a": {"dtype": "F32", "shape": [4], "data_offsets": [1, 17]}}
    back = read_safetensors(raw_safetensors(tmp_path / "m.safetensors", header, b"\x07" + values.tobytes()))
    assert back["a"].flags.aligned and np.array_equal(back["a"], values) and back["b"][0] == 7


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize("header, data, length, message", [
    (b"", b"", 0, "not UTF-8 JSON"),
    (b"\xff\xfe\x00garbage", b"", None, "not UTF-8 JSON"),
    (b'{"w": {"dtype": "F32",', b"", None, "not UTF-8 JSON"),
    (b"[1, 2]", b"", None, "not an object"),
    ({"w": entry()}, bytes(8), 10**6, "header length 1000000 runs past the end"),
    ({"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8), None, "tensor 'w': header entry has no 'dtype'"),
    ({"w": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "tensor 'w': header entry has no 'data_offsets'"),
    ({"w": entry("F8_E4M3")}, bytes(8), None, "tensor 'w': unknown dtype 'F8_E4M3'"),
    ({"w": entry(shape=(3,))}, bytes(8), None, r"tensor 'w': 8 data bytes, but F32 \[3\] needs 12"),
    ({"w": entry(), "v": entry(offsets=(4, 12))}, bytes(12), None, "overlap"),
    ({"w": entry(), "v": entry(offsets=(8, 16))}, bytes(12), None, "truncated file: tensor 'v' needs data bytes"),
])
def test_corrupt_safetensors(tmp_path, header, data, length, message):
    path = raw_safetensors(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(CheckpointError, match=f"bad.safetensors: .*{message}"):
        read_safetensors(path)


def test_too_short_file(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="short.safetensors: .*shorter than the 8-byte header"):
        read_safetensors(tmp_path / "short.safetensors")


# --- quantization --------------------------------------------------------------------------------------------

def test_packing_worked_example():
    """architecture.md §9.3: 0..15 four times -> scale -1, bias 15, words 0x89abcdef, 0x01234567 (LSB first)."""
    w = np.tile(np.arange(16, dtype=np.float32), 4)[None]
    packed, scales, biases = quantize_affine(w, bits=4, group_size=64)
    assert packed.tolist() == [[0x89ABCDEF, 0x01234567] * 4]
    assert bf16_to_float32(scales).tolist() == [[-1.0]] and bf16_to_float32(biases).tolist() == [[15.0]]
    assert np.array_equal(dequantize_affine(packed, scales, biases), w)
    one, zero = float32_to_bf16(np.ones((1, 1), np.float32)), np.zeros((1, 1), np.uint16)
    words8 = np.array([[0x04030201] * 16], dtype=np.uint32)  # 8-bit: element j is byte j
    assert dequantize_affine(words8, one, zero, bits=8)[0, :8].tolist() == [1, 2, 3, 4, 1, 2, 3, 4]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quantize_matches_mlx(bits, group_size):
    import mlx.core as mx
    rng = np.random.default_rng(100 * bits + group_size)
    w = rng.standard_normal((3, 40, 256), dtype=np.float32) * rng.uniform(0.1, 3, (3, 40, 1)).astype(np.float32)
    w[0, 0, :group_size] = 0.0  # an all-zero group
    packed, scales, biases = quantize_affine(w, bits, group_size)
    mp, ms, mb = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
    assert np.array_equal(packed, np.array(mp))
    assert np.array_equal(scales, float32_to_bf16(np.array(ms)))
    assert np.array_equal(biases, float32_to_bf16(np.array(mb)))
    ours = dequantize_affine(packed, scales, biases, bits, group_size)
    theirs = mx.dequantize(mp, mx.array(bf16_to_float32(scales)), mx.array(bf16_to_float32(biases)),
                           group_size=group_size, bits=bits)
    assert np.array_equal(ours, np.array(theirs))
    rel_rms = np.sqrt(np.mean((ours - w) ** 2) / np.mean(w ** 2))
    assert rel_rms < (0.12 if bits == 4 else 0.01)


# --- tiny checkpoints ----------------------------------------------------------------------------------------

def test_tiny_layout(tiny):
    c = tiny.config
    assert set(tiny.tensors) == expected_keys(c["num_hidden_layers"], c["full_attention_interval"])
    for name, a in tiny.tensors.items():
        quantized_weight = is_quantized(name, tiny.tensors) and name.endswith(".weight")
        want = np.float32 if name.endswith("A_log") else np.uint32 if quantized_weight else np.uint16
        assert a.dtype == want, name
    H = c["hidden_size"]
    assert tiny.tensors["model.layers.0.mlp.gate.weight"].shape == (c["num_experts"], H // 4)  # 8-bit
    assert tiny.tensors["model.layers.3.mlp.shared_expert_gate.weight"].shape == (1, H // 4)  # 8-bit
    assert tiny.tensors["model.layers.3.self_attn.o_proj.weight"].shape == (H, H // 8)  # 4-bit
    assert tiny.tensors["model.layers.0.mlp.switch_mlp.down_proj.scales"].shape == (
        c["num_experts"], H, c["moe_intermediate_size"] // 64)
    assert tiny.tensors["model.layers.0.linear_attn.conv1d.weight"].shape[1:] == (4, 1)
    assert abs(bf16_to_float32(tiny.tensors["model.norm.weight"]).mean() - 1) < 0.05  # stored as 1+w
    assert c["vocab_size"] % 64 == 0 and tiny.tokenizer_json and tiny.chat_template


def test_tiny_is_deterministic_per_seed(tiny):
    assert_same_tensors(build_tiny(seed=11).tensors, tiny.tensors)
    other = build_tiny(seed=12).tensors
    assert not np.array_equal(other["lm_head.weight"], tiny.tensors["lm_head.weight"])


def test_mlx_lm_loads_tiny_and_logits_are_sensible(tiny_dir):
    """mlx-lm's strict loader accepts the key set and shapes; the forward pass gives O(1), spread logits."""
    import mlx.core as mx
    from mlx_lm.utils import load_model
    model, _ = load_model(Path(tiny_dir))
    ids = np.random.default_rng(4).integers(0, 480, (1, 16))
    logits = np.array(model(mx.array(ids)).astype(mx.float32))[0]
    assert np.isfinite(logits).all()
    assert 0.5 < logits.std(axis=-1).mean() < 10


def test_round_trip_sharded(tiny, tiny_dir):
    shards = sorted(p.name for p in Path(tiny_dir).glob("model-*.safetensors"))
    assert len(shards) >= 3 and (Path(tiny_dir) / "model.safetensors.index.json").exists()
    loaded = load_checkpoint(tiny_dir)
    assert_same_tensors(loaded.tensors, tiny.tensors)
    assert loaded.config == tiny.config and loaded.quantization == tiny.quantization
    assert loaded.generation_config == tiny.generation_config
    assert {Path(f).name for f in loaded.files.values()} == set(shards)
    assert loaded.tokenizer_json is None and (Path(tiny_dir) / "tokenizer.json").read_text() == tiny.tokenizer_json
    assert (Path(tiny_dir) / "chat_template.jinja").read_text() == tiny.chat_template


def test_round_trip_single_file_and_flat_config(tmp_path):
    ckpt = build_tiny(seed=21)
    out = write_checkpoint(ckpt, tmp_path)
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()

    def flatten(cfg):  # the flat qwen3_5_moe_text form, with rope_type spelled `type` as mlx-lm writes it
        cfg.update(cfg.pop("text_config"))
        cfg["rope_parameters"]["type"] = cfg["rope_parameters"].pop("rope_type")
        del cfg["quantization_config"]
    edit_json(out / "config.json", flatten)
    loaded = load_checkpoint(str(out))
    assert loaded.config == ckpt.config and loaded.quantization == ckpt.quantization
    assert_same_tensors(loaded.tensors, ckpt.tensors)


def test_hf_layout_and_ignored_keys(tiny, ckpt_dir):
    """HF names (model.language_model.*, lm_head.*), conv1d [C,1,K], zero-centred norms, vision/MTP extras."""
    rng = np.random.default_rng(5)
    index_path = ckpt_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    extras = {"vision_tower.blocks.0.attn.qkv.weight": (4, 8), "model.visual.patch_embed.weight": (2, 2),
              "mtp.layers.0.input_layernorm.weight": (8,), "language_model.vision_tower.x.weight": (3,)}
    first_shard = index["weight_map"]["language_model.lm_head.weight"]

    def to_hf(key: str) -> str:
        key = key.replace("language_model.model.", "model.language_model.")
        return key.replace("language_model.lm_head", "lm_head")

    def edit(t):
        for key in list(t):
            a = t.pop(key)
            if key.endswith("conv1d.weight"):
                a = np.ascontiguousarray(np.moveaxis(a, 1, 2))
            elif key.endswith(("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")):
                a = float32_to_bf16(bf16_to_float32(a) - 1.0)
            t[to_hf(key)] = a

    for shard in sorted(set(index["weight_map"].values())):
        rewrite_shard(ckpt_dir / shard, edit)
    rewrite_shard(ckpt_dir / first_shard, lambda t: t.update(
        {k: float32_to_bf16(rng.standard_normal(shape, dtype=np.float32)) for k, shape in extras.items()}))
    index["weight_map"] = {to_hf(k): v for k, v in index["weight_map"].items()} | dict.fromkeys(extras, first_shard)
    index_path.write_text(json.dumps(index))
    loaded = load_checkpoint(ckpt_dir)
    assert loaded.tensors.keys() == tiny.tensors.keys()
    for name, a in tiny.tensors.items():
        if name.endswith(("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")):
            np.testing.assert_allclose(bf16_to_float32(loaded.tensors[name]), bf16_to_float32(a), atol=8e-3)
        else:
            assert np.array_equal(loaded.tensors[name], a), name


def test_reads_mlx_lm_convert_output(tiny, tmp_path):
    """An HF-layout BF16 export of the tiny model, converted by `mlx_lm.convert -q`, loads with the same config,
    quantization, key set and unquantized tensors (quantized ones differ only by re-quantization)."""
    from mlx_lm import convert
    hf, c = {}, tiny.config
    for name, a in tiny.tensors.items():
        module = name[:-len(".weight")]
        if name.endswith((".scales", ".biases")):
            continue
        if is_quantized(name, tiny.tensors):
            bits = 8 if module.endswith(("mlp.gate", "shared_expert_gate")) else 4
            a = float32_to_bf16(dequantize_affine(*(tiny.tensors[f"{module}.{p}"] for p in QUANTIZED), bits))
        elif name.endswith("conv1d.weight"):
            a = np.ascontiguousarray(np.moveaxis(a, 1, 2))
        elif name.endswith(("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")):
            a = float32_to_bf16(bf16_to_float32(a) - 1.0)
        hf[name if name.startswith("lm_head") else "model.language_model." + name[len("model."):]] = a
    for i in range(c["num_hidden_layers"]):  # HF stores the experts fused, gate rows then up rows
        p = f"model.language_model.layers.{i}.mlp."
        hf[p + "experts.gate_up_proj"] = np.concatenate(
            [hf.pop(p + "switch_mlp.gate_proj.weight"), hf.pop(p + "switch_mlp.up_proj.weight")], axis=1)
        hf[p + "experts.down_proj"] = hf.pop(p + "switch_mlp.down_proj.weight")
    src = tmp_path / "hf"
    src.mkdir()
    write_safetensors(src / "model.safetensors", hf)
    (src / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": c}))
    (src / "tokenizer.json").write_text(tiny.tokenizer_json)
    convert(str(src), str(tmp_path / "mlx"), quantize=True)
    loaded = load_checkpoint(tmp_path / "mlx")
    assert loaded.config == c and loaded.quantization == tiny.quantization
    assert loaded.tensors.keys() == tiny.tensors.keys()
    for name, a in tiny.tensors.items():
        if not is_quantized(name, tiny.tensors):
            assert np.array_equal(loaded.tensors[name], a), name


def test_canonical_names():
    assert canonical_name("language_model.model.layers.0.mlp.gate.weight") == "model.layers.0.mlp.gate.weight"
    assert canonical_name("model.language_model.norm.weight") == "model.norm.weight"
    assert canonical_name("language_model.lm_head.scales") == "lm_head.scales"
    assert canonical_name("lm_head.weight") == "lm_head.weight"
    assert canonical_name("mtp.fc.weight") is None and canonical_name("vision_tower.patch.weight") is None


def test_build_random_geometry_and_statistics():
    cfg = dict(TINY_TEXT_CONFIG, hidden_size=512, num_experts=32, moe_intermediate_size=256)
    ckpt = build_random(cfg, seed=31)
    assert set(ckpt.tensors) == expected_keys(cfg["num_hidden_layers"], cfg["full_attention_interval"])
    name = "model.layers.1.mlp.switch_mlp.down_proj"
    w = dequantize_affine(*(ckpt.tensors[f"{name}.{p}"] for p in QUANTIZED))
    assert w.shape == (32, 512, 256) and abs(w.mean()) < 2e-3 and 0.8 < w.std() * np.sqrt(256) / 0.5 < 1.2
    assert not np.array_equal(build_random(cfg, seed=32).tensors[f"{name}.weight"], ckpt.tensors[f"{name}.weight"])


# --- load_checkpoint errors ----------------------------------------------------------------------------------

def test_truncated_shard(ckpt_dir):
    shard = shard_of(ckpt_dir, "language_model.model.layers.7.mlp.switch_mlp.up_proj.weight")
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name}: truncated file: tensor '.*' needs data bytes"):
        load_checkpoint(ckpt_dir)


@pytest.mark.parametrize("prefix, message", [
    (b"\x00" * 4, "shorter than the 8-byte header"),
    (struct.pack("<Q", 1 << 40), "header length 1099511627776 runs past the end"),
    (struct.pack("<Q", 12) + b"not json at all", "not UTF-8 JSON"),
])
def test_corrupt_shard_header(ckpt_dir, prefix, message):
    shard = shard_of(ckpt_dir, "language_model.model.norm.weight")
    shard.write_bytes(prefix)
    with pytest.raises(CheckpointError, match=f"{shard.name}: .*{message}"):
        load_checkpoint(ckpt_dir)


def test_unknown_dtype_in_shard(ckpt_dir):
    key = "language_model.model.layers.0.linear_attn.A_log"
    shard = shard_of(ckpt_dir, key)
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = raw[8:8 + n].replace(f'"{key}":{{"dtype":"F32"'.encode(), f'"{key}":{{"dtype":"F4X"'.encode())
    assert len(header) == n
    shard.write_bytes(raw[:8] + header + raw[8 + n:])
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor '{key}': unknown dtype 'F4X'"):
        load_checkpoint(ckpt_dir)


def test_missing_shard(ckpt_dir):
    shard = shard_of(ckpt_dir, "language_model.lm_head.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json: shard '{shard.name}' .* does not exist"):
        load_checkpoint(ckpt_dir)


def test_tensor_missing_from_its_shard(ckpt_dir):
    key = "language_model.model.layers.2.linear_attn.dt_bias"
    shard = shard_of(ckpt_dir, key)
    rewrite_shard(shard, lambda t: t.pop(key))
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor '{key}' is listed in .* but not in this shard"):
        load_checkpoint(ckpt_dir)


def test_unknown_model_type(ckpt_dir):
    edit_json(ckpt_dir / "config.json", lambda c: c.update(model_type="llama"))
    with pytest.raises(CheckpointError, match=r"config.json: unsupported model_type 'llama' \(Lily runs qwen3_5_moe"):
        load_checkpoint(ckpt_dir)


def test_quantization_disagrees_with_shapes(ckpt_dir):
    key = "language_model.model.layers.4.mlp.gate"
    edit_json(ckpt_dir / "config.json", lambda c: c["quantization"].pop(key))  # now the 4-bit global applies
    shard = shard_of(ckpt_dir, key + ".weight")
    with pytest.raises(CheckpointError, match=f"{shard.name}: tensor 'model.layers.4.mlp.gate.weight': .*"
                                              "give bits 8, group_size 64, but config.json quantization says bits 4"):
        load_checkpoint(ckpt_dir)


def test_global_group_size_disagrees_with_shapes(ckpt_dir):
    def regroup(cfg):
        cfg["quantization"]["group_size"] = 128
        cfg["quantization"] = {k: v for k, v in cfg["quantization"].items() if not isinstance(v, dict)}
    edit_json(ckpt_dir / "config.json", regroup)
    with pytest.raises(CheckpointError, match="tensor 'lm_head.weight': .*give bits 4, group_size 64, "
                                              "but config.json quantization says bits 4, group_size 128"):
        load_checkpoint(ckpt_dir)


def drop_lm_head_biases(t):
    del t["language_model.lm_head.biases"]


def unquantize_lm_head(t):
    for p in QUANTIZED:
        del t[f"language_model.lm_head.{p}"]
    t["language_model.lm_head.weight"] = float32_to_bf16(np.random.default_rng(6).standard_normal((8, 256)))


@pytest.mark.parametrize("edit, message", [
    (drop_lm_head_biases, r"tensor 'lm_head.weight': not a quantized triplet: weight uint32 \[\d+, 32\], "
                          r"scales uint16 \[\d+, 4\], biases missing"),
    (unquantize_lm_head, r"tensor 'lm_head.weight' is stored unquantized \(uint16\), but config.json "
                         "quantization says bits 4, group_size 64"),
])
def test_bad_quantized_triplet(ckpt_dir, edit, message):
    index_path = ckpt_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = shard_of(ckpt_dir, "language_model.lm_head.weight")
    rewrite_shard(shard, edit)
    keys = read_safetensors(shard).keys()
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name or k in keys}
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{shard.name}: {message}"):
        load_checkpoint(ckpt_dir)


def test_missing_quantization_section(ckpt_dir):
    edit_json(ckpt_dir / "config.json", lambda c: [c.pop("quantization"), c.pop("quantization_config")])
    with pytest.raises(CheckpointError, match="config.json: quantization is missing"):
        load_checkpoint(ckpt_dir)


@pytest.mark.parametrize("field, value, message", [
    ("num_key_value_heads", None, "text_config.num_key_value_heads is missing"),
    ("hidden_size", None, "text_config.hidden_size is missing"),
    ("num_key_value_heads", 0, "text_config.num_key_value_heads must be a positive integer, got 0"),
    ("num_key_value_heads", 3, r"text_config.num_attention_heads \(4\) must be divisible by "
                               r"text_config.num_key_value_heads \(3\)"),
    ("head_dim", "64", "text_config.head_dim must be a positive integer, got '64'"),
    ("num_experts_per_tok", 17, r"text_config.num_experts_per_tok \(17\) exceeds"),
    ("rms_norm_eps", -1e-6, "text_config.rms_norm_eps must be a positive number"),
    ("hidden_act", "gelu", "text_config.hidden_act is 'gelu'; Lily supports only 'silu'"),
    ("layer_types", ["full_attention"] * 8, "text_config.layer_types must follow full_attention_interval 4"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0},
     "text_config.rope_parameters.original_max_position_embeddings must be a positive integer"),
])
def test_bad_config_field(ckpt_dir, field, value, message):
    def edit(cfg):
        if value is None:
            del cfg["text_config"][field]
        else:
            cfg["text_config"][field] = value
    edit_json(ckpt_dir / "config.json", edit)
    with pytest.raises(CheckpointError, match=f"config.json: {message}"):
        load_checkpoint(ckpt_dir)


def test_bad_generation_config_and_int_eos(ckpt_dir):
    edit_json(ckpt_dir / "generation_config.json", lambda g: g.update(eos_token_id=7))
    assert load_checkpoint(ckpt_dir).generation_config["eos_token_id"] == [7]
    edit_json(ckpt_dir / "generation_config.json", lambda g: g.update(eos_token_id="<|im_end|>"))
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id must be a token id"):
        load_checkpoint(ckpt_dir)


def test_unresolvable_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model_path(str(tmp_path / "nope" / "deeper"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model_path(tmp_path / "file")
