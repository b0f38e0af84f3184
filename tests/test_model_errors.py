"""Bad checkpoints and bad requests give a clear Python exception naming the file, tensor or field, never a
crash; after every failure a good model still loads and generates in the same process."""

import json
import secrets
import shutil
from pathlib import Path

import numpy as np
import pytest

import lily
from lily.safetensors_io import CheckpointError, bf16_to_float32, read_safetensors, write_safetensors
from lily.tiny import build_tiny, write_checkpoint
from lily.tiny_tokenizer import tiny_vocab_size

SHARD = "model.safetensors"


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    return write_checkpoint(build_tiny(seed=secrets.randbits(32)), tmp_path_factory.mktemp("good") / "model")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return np.random.default_rng(secrets.randbits(64)).integers(0, tiny_vocab_size(), 6).tolist()


@pytest.fixture(scope="module")
def expected_text(good_dir, prompt) -> str:
    return lily.generate(lily.load(good_dir), prompt, max_tokens=4, temperature=0.0)


@pytest.fixture
def bad_dir(good_dir, tmp_path) -> Path:
    """A copy of the good checkpoint for the test to corrupt."""
    return Path(shutil.copytree(good_dir, tmp_path / "model"))


@pytest.fixture
def refused(good_dir, prompt, expected_text):
    """refused(path, exception type, *fragments): loading fails with that exception, whose message contains every
    fragment; then the good checkpoint still loads and generates exactly what it did before."""

    def check(path, exc_type, *fragments, **load_kwargs) -> str:
        with pytest.raises(exc_type) as info:
            lily.load(path, **load_kwargs)
        message = str(info.value)
        for fragment in fragments:
            assert str(fragment) in message, f"{fragment!r} not in: {message}"
        assert lily.generate(lily.load(good_dir), prompt, max_tokens=4, temperature=0.0) == expected_text
        return message

    return check


def _edit_shard(model_dir: Path, edit) -> Path:
    """Rewrites the shard with `edit(tensors)` applied to a copy of its tensors (keys as stored)."""
    path = model_dir / SHARD
    tensors = {k: np.array(v) for k, v in read_safetensors(path).items()}
    edit(tensors)
    write_safetensors(path, tensors, metadata={"format": "mlx"})
    return path


def _edit_config(model_dir: Path, edit) -> Path:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("name, fragments", [
    ("model.layers.3.self_attn.k_norm.weight", ["model.layers.3.self_attn.k_norm.weight"]),
    ("model.layers.0.linear_attn.A_log", ["model.layers.0.linear_attn.A_log"]),
    ("model.norm.weight", ["model.norm.weight"]),
    ("model.layers.5.mlp.switch_mlp.down_proj.scales", ["model.layers.5.mlp.switch_mlp.down_proj", "scales", SHARD]),
])
def test_missing_tensor(bad_dir, refused, name, fragments):
    _edit_shard(bad_dir, lambda t: t.pop("language_model." + name))
    refused(bad_dir, ValueError, bad_dir, *fragments)  # the checkpoint named too


def test_missing_quantized_module(bad_dir, refused):
    def drop(t):
        for part in ("weight", "scales", "biases"):
            del t[f"language_model.model.layers.2.linear_attn.in_proj_z.{part}"]

    _edit_shard(bad_dir, drop)
    refused(bad_dir, ValueError, "model.layers.2.linear_attn.in_proj_z")


@pytest.mark.parametrize("name", ["model.layers.1.input_layernorm.weight", "model.layers.0.linear_attn.conv1d.weight",
                                  "model.layers.6.mlp.switch_mlp.up_proj.weight"])
def test_wrong_shape(bad_dir, refused, name):
    key = "language_model." + name

    def shrink(t):
        t[key] = np.ascontiguousarray(t[key][:-1])

    shard = _edit_shard(bad_dir, shrink)
    refused(bad_dir, ValueError, name, shard, "shape")


def test_scales_stored_as_f32(bad_dir, refused):
    key = "language_model.model.layers.0.mlp.gate.scales"

    def widen(t):
        t[key] = bf16_to_float32(t[key])

    shard = _edit_shard(bad_dir, widen)
    refused(bad_dir, ValueError, "model.layers.0.mlp.gate", shard, "BF16")


def test_vector_in_unsupported_dtype(bad_dir, refused):
    key = "language_model.model.layers.0.linear_attn.A_log"

    def halve(t):
        t[key] = t[key].astype(np.float16)

    shard = _edit_shard(bad_dir, halve)
    refused(bad_dir, ValueError, "model.layers.0.linear_attn.A_log", shard, "F16")


def test_truncated_shard(bad_dir, refused):
    shard = bad_dir / SHARD
    data = shard.read_bytes()
    shard.write_bytes(data[:len(data) - 1000])
    refused(bad_dir, CheckpointError, shard, "truncated")


def test_corrupt_header_json(bad_dir, refused):
    shard = bad_dir / SHARD
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\xff{[\x00"
    shard.write_bytes(bytes(data))
    refused(bad_dir, CheckpointError, shard, "header")


def test_corrupt_header_length(bad_dir, refused):
    shard = bad_dir / SHARD
    data = bytearray(shard.read_bytes())
    data[:8] = (len(data) * 2).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    refused(bad_dir, CheckpointError, shard, "header length")


def test_missing_shard_of_an_index(good_dir, tmp_path, refused):
    sharded = write_checkpoint(build_tiny(), tmp_path / "sharded", max_shard_bytes=2_000_000)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    refused(sharded, CheckpointError, shards[1].name, "model.safetensors.index.json")


def test_unknown_model_type(bad_dir, refused):
    config = _edit_config(bad_dir, lambda c: c.update(model_type="llama"))
    refused(bad_dir, CheckpointError, config, "model_type", "'llama'")


def test_config_json_not_json(bad_dir, refused):
    config = bad_dir / "config.json"
    config.write_text("{\"model_type\": ")
    refused(bad_dir, CheckpointError, config, "JSON")


@pytest.mark.parametrize("field, value, fragments", [
    ("hidden_size", 320, ["hidden_size", "lm_head.weight"]),
    ("vocab_size", 576, ["model.embed_tokens.weight", "576"]),
    ("num_experts", 8, ["model.layers.0.mlp.gate.weight", "[8, "]),
    ("head_dim", 32, ["model.layers.3.self_attn", "head_dim"]),
])
def test_config_disagrees_with_tensors(bad_dir, refused, field, value, fragments):
    _edit_config(bad_dir, lambda c: c["text_config"].update({field: value}))
    refused(bad_dir, ValueError, *fragments)


def test_config_with_fewer_layers_than_the_tensors(bad_dir, refused):
    def fewer_layers(c):
        c["text_config"]["num_hidden_layers"] = 4
        del c["text_config"]["layer_types"]

    _edit_config(bad_dir, fewer_layers)
    # Layers 4..7 of the shard would be silently ignored: the config does not describe this checkpoint.
    message = refused(bad_dir, ValueError)
    assert "num_hidden_layers" in message or "model.layers.4." in message, message


def test_missing_model_directory(tmp_path, refused):
    missing = tmp_path / "no-such-model"
    refused(missing, FileNotFoundError, missing)


def test_unknown_backend(good_dir, refused):
    message = refused(good_dir, ValueError, "nope", backend="nope")
    for backend in lily.backend_names():
        assert backend in message


def test_a_prompt_past_the_context_is_a_context_limit_error(good_dir, prompt):
    """Its own type (a ValueError), which `lily chat` tells from other errors to drop the message and go on."""
    session = lily.load(good_dir).session(max_context=16)
    with pytest.raises(lily.ContextLimitError, match="exceeds the context limit"):
        lily.generate(session.model, (prompt * 3)[:17], session=session, max_tokens=2)


def test_prompt_longer_than_context_limit(good_dir, prompt, expected_text):
    model = lily.load(good_dir)
    session = model.session(max_context=16)
    with pytest.raises(ValueError, match="prompt of 17 tokens exceeds the context limit of 16 tokens"):
        lily.generate(model, (prompt * 3)[:17], session=session, max_tokens=2)
    assert lily.generate(model, prompt, session=session, max_tokens=4, temperature=0.0) == expected_text
