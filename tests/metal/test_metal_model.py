"""The whole forward pass composed from the Metal kernels, dispatched through the CPU harness, reproduces the CPU
backend's logits on the tiny model: once as one prefill chunk (the GEMM paths) and once token by token (decode)."""
import numpy as np
import pytest

from lily.tiny import build_tiny

POSITIONS = 32


@pytest.fixture(scope="module")
def tiny():
    ckpt = build_tiny()
    return {k: v for k, v in ckpt.config.items() if isinstance(v, (int, float, bool))}, ckpt


@pytest.mark.parametrize("prefill_chunk", [POSITIONS, 1], ids=["prefill", "decode"])
def test_tiny_model_matches_cpu(core, tiny, rng, prefill_chunk):
    config, ckpt = tiny
    tokens = rng.integers(0, config["vocab_size"], POSITIONS).astype(np.int32)
    logits = {}
    for backend in ("cpu", "metal"):
        model = core.Model(config, ckpt.tensors, ckpt.files, backend)
        logits[backend] = model.session(max_context=POSITIONS, prefill_chunk=prefill_chunk).forward_all(tokens)
    ref, got = logits["cpu"], logits["metal"]
    assert np.isfinite(got).all(), f"non-finite Metal logits at positions {np.unique(np.nonzero(~np.isfinite(got))[0])}"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    agree = np.mean(got.argmax(axis=1) == ref.argmax(axis=1))
    assert err < 5e-2, f"relative error of the logits {err:.2e}"
    assert agree >= 0.9, f"top-1 agrees at {agree:.0%} of {POSITIONS} positions"
