"""Token selection on the device (metal/sample.metal, launched by csrc/backend/metal/sample.cpp) in the CPU harness,
against the host sampler (core/sample.cpp, as lily._core.Sampler).

The tiny model's decode loop runs on the "metal" backend with device selection (Generator.on_device: the kernel
picks each token, records it in the penalty state and advances the draw counter). A second session of the same
model then replays the chosen tokens to recover the logits each selection saw, and a host Sampler given the same
prompt and history must choose the same token at every step (same rules, same counter-based draw), with the same
logprob. The history (ids already in the session before the prompt, which count for the penalties) is the prompt's
most likely next tokens, so that a penalty the kernel got wrong changes the choice. The vocabulary (4096, of which the first N_VALID may be
chosen) is larger than the kernel's 1024 threads, so each thread scans several ids and the top-k radix selection
and the ordered compaction run as at the real vocabulary. Every configuration runs in every thread order, and in the
ASan/UBSan build (test_asan.py).
"""
import secrets

import numpy as np
import pytest

import lily
from lily.tiny import TINY_TEXT_CONFIG, build_tiny

VOCAB = 4096
N_VALID = 4000  # not a multiple of the kernel's 1024 threads
PROMPT_LEN = 6
HISTORY_LEN = 16
STEPS = 6
# name: sampling parameters
CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0, top_k=1024),  # the most candidates the kernel holds
    "top_k_top_p": dict(temperature=0.8, top_k=40, top_p=0.6),
    "min_p_penalties": dict(temperature=1.2, top_k=200, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.3,
                            frequency_penalty=0.4),
    # A negative frequency penalty rewards repeats (greedy: net +9 after one use, which the tiny model's logits never
    # overcome), so generated tokens come back and the counts the kernel keeps decide later choices.
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=-10.0),
    "top_k_penalties": dict(temperature=0.7, top_k=8, repetition_penalty=1.5, presence_penalty=1.0,
                            frequency_penalty=-4.0),
}


@pytest.fixture(scope="module")
def model(core):
    """The tiny model with a VOCAB-row lm_head, on the harness's metal backend."""
    ckpt = build_tiny(text_config={**TINY_TEXT_CONFIG, "vocab_size": VOCAB})
    config = {k: v for k, v in ckpt.config.items() if isinstance(v, (int, float, bool))}
    return core.Model(config, ckpt.tensors, ckpt.files, "metal")


@pytest.mark.parametrize("name", CONFIGS)
def test_device_selection_matches_host_sampler(core, model, monkeypatch, name, thread_order):
    sampling, order = CONFIGS[name], thread_order
    seed = secrets.randbits(64)
    monkeypatch.setenv("LILY_METAL_ORDER", order)
    monkeypatch.setenv("LILY_METAL_SEED", str(seed))
    rng = np.random.default_rng(seed)
    params = dict(sampling, seed=seed)  # all 64 bits of the draw's seed in play
    prompt = rng.integers(0, N_VALID, PROMPT_LEN).astype(np.int32)
    likely = model.session(max_context=64).prefill(prompt)
    history = np.argsort(-likely[:N_VALID], kind="stable")[:HISTORY_LEN].astype(np.int32)
    print(f"order {order}, params {params}, prompt {prompt.tolist()}, history {history.tolist()}")
    replay = model.session(max_context=64)
    replay.prefill(history)
    logits = replay.prefill(prompt)

    session = model.session(max_context=64)
    session.prefill(history)  # already in the session: they count for the penalties
    gen = core.Generator(session, core.SamplingParams(**params), [], STEPS, N_VALID)
    assert gen.on_device, f"{name}: the metal backend should select these tokens on the device"
    gen.prefill(prompt)
    before = core.testing.metal_kernels()["sample"]
    steps = [gen.next()[:2] for _ in range(STEPS)]  # (token, logprob)
    assert core.testing.metal_kernels()["sample"] - before >= STEPS - 1, "the sample kernel did not pick the tokens"

    host = lily._core.Sampler(lily._core.SamplingParams(**params), VOCAB, N_VALID)
    host.add_prompt(history.tolist() + prompt.tolist())
    for i, (token, logprob) in enumerate(steps):
        want = host.sample(logits)
        p = host.probs(logits)
        assert token == want.token, (f"{name}, step {i}: device chose {token} (host probability {p[token]:.4g}), "
                                     f"host chose {want.token} (probability {p[want.token]:.4g})")
        assert abs(logprob - want.logprob) < 1e-4, f"{name}, step {i}: logprob {logprob} != host {want.logprob}"
        host.accept(token)
        if i + 1 < STEPS:
            logits = replay.prefill(np.array([token], np.int32))


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
