"""The whole forward pass composed from the Metal kernels, dispatched through the CPU harness, reproduces the CPU
backend's logits on the tiny model: as one prefill call of 80 tokens (the GEMM paths, and the chunked Gated DeltaNet
over a whole 64-token chunk and a partial one), as calls of 33 tokens (chunked calls that carry the state into the
next, and a last call of 14 below the chunked form's threshold), token by token (decode), and as one prefill call
with every ablation switch off (the plain paths)."""
import numpy as np
import pytest

from lily.tiny import build_tiny

POSITIONS = 80

# id: (tokens per forward call, switches off)
RUNS = {"prefill": (POSITIONS, False), "chunks": (33, False), "decode": (1, False), "prefill-off": (POSITIONS, True)}


@pytest.fixture(scope="module")
def tiny():
    ckpt = build_tiny()
    return {k: v for k, v in ckpt.config.items() if isinstance(v, (int, float, bool))}, ckpt


@pytest.mark.parametrize("run", RUNS)
def test_tiny_model_matches_cpu(core, tiny, rng, run):
    config, ckpt = tiny
    prefill_chunk, off = RUNS[run]
    disable = [name for name, _, _ in core.optimisations()] if off else []
    tokens = rng.integers(0, config["vocab_size"], POSITIONS).astype(np.int32)
    logits = {}
    for backend in ("cpu", "metal"):
        model = core.Model(config, ckpt.tensors, ckpt.files, backend, disable=disable)
        logits[backend] = model.session(max_context=POSITIONS, prefill_chunk=prefill_chunk).forward_all(tokens)
    ref, got = logits["cpu"], logits["metal"]
    assert np.isfinite(got).all(), f"non-finite Metal logits at positions {np.unique(np.nonzero(~np.isfinite(got))[0])}"
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    agree = np.mean(got.argmax(axis=1) == ref.argmax(axis=1))
    assert err < 5e-2, f"relative error of the logits {err:.2e}"
    assert agree >= 0.9, f"top-1 agrees at {agree:.0%} of {POSITIONS} positions"
