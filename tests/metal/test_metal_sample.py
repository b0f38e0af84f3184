"""Token selection on the device (metal/sample.metal, launched by csrc/backend/metal/sample.cpp) in the CPU harness,
against the host sampler (core/sample.cpp, as lily._core.Sampler): tests/device_sampling.py says how. Every
configuration runs in every thread order, and in the ASan/UBSan build (test_asan.py).
"""
import secrets

import numpy as np
import pytest

from device_sampling import CONFIGS, N_VALID, PROMPT_LEN, STEPS, VOCAB, check_device_selection
from lily.tiny import TINY_TEXT_CONFIG, build_tiny


@pytest.fixture(scope="module")
def model(core):
    """The tiny model with a VOCAB-row lm_head, on the harness's metal backend."""
    ckpt = build_tiny(text_config={**TINY_TEXT_CONFIG, "vocab_size": VOCAB})
    config = {k: v for k, v in ckpt.config.items() if isinstance(v, (int, float, bool))}
    return core.Model(config, ckpt.tensors, ckpt.files, "metal")


@pytest.mark.parametrize("name", CONFIGS)
def test_device_selection_matches_host_sampler(core, model, monkeypatch, name, thread_order):
    seed = secrets.randbits(64)
    monkeypatch.setenv("LILY_METAL_ORDER", thread_order)
    monkeypatch.setenv("LILY_METAL_SEED", str(seed))
    print(f"order {thread_order}")
    check_device_selection(core, model, name, seed, lambda: core.testing.metal_kernels()["sample"])


def test_host_path_when_the_device_cannot_select(core, model):
    """Selection stays on the host when the kept set may exceed the kernel's 1024 candidates (top-k off or above
    1024 over 4000 ids) or when top_logprobs are asked for (reported by the host sampler only)."""
    for params, on_device in ((dict(temperature=0.0), True), (dict(temperature=0.7, top_k=1024), True),
                              (dict(temperature=0.7), False), (dict(temperature=0.7, top_k=1025), False),
                              (dict(temperature=0.0, top_logprobs=3), False)):
        gen = core.Generator(model.session(max_context=16), core.SamplingParams(**params), [], 1, N_VALID)
        assert gen.on_device == on_device, params



@pytest.mark.parametrize("where", ["same session", "another session"])
def test_a_device_loop_continued_after_another_one_ran_is_refused(core, model, where):
    """The backend's in-flight results (Backend::fetch_result slots) are the model's, not a session's: a device-loop
    generation continued after another one on the same model ran raises SessionConflictError instead of reading the
    other's tokens, and the other one is right."""
    rng = np.random.default_rng(secrets.randbits(64))
    first, second = (rng.integers(0, N_VALID, PROMPT_LEN).astype(np.int32) for _ in range(2))
    params = core.SamplingParams(temperature=0.0)

    def tokens(gen, prompt, n):
        gen.prefill(prompt)
        return [gen.next()[0] for _ in range(n)]

    want = tokens(core.Generator(model.session(max_context=64), params, [], STEPS, N_VALID), second, STEPS)
    session = model.session(max_context=64)
    older = core.Generator(session, params, [], STEPS, N_VALID)
    tokens(older, first, 2)
    if where == "same session":
        session.reset()
    newer = core.Generator(session if where == "same session" else model.session(max_context=64), params, [], STEPS,
                           N_VALID)
    got = tokens(newer, second, 2)
    with pytest.raises(core.SessionConflictError, match="cannot continue: start a new one"):
        older.next()
    assert got + [newer.next()[0] for _ in range(STEPS - 2)] == want
