"""Token selection on the device (metal/sample.metal, launched by csrc/backend/metal/sample.cpp) in the CPU harness,
against the host sampler (core/sample.cpp, as lily._core.Sampler) and, kernel against kernel, the split selection
(switch sample_split: sample_part over slices of SAMPLE_SLICE = 4096 ids, then sample_merge) against the
one-threadgroup `sample` it replaces.

In the decode loop (tests/device_sampling.py says how): the split over three slices in every thread order, and the
one-threadgroup kernel in forward order (its thread orders are covered by the direct selections below, which cost a
hundredth as much: the model's forward passes, not the selection, are what takes seconds in the harness). Directly
(core.testing.run_op "sample", both kernels, every thread order): the real vocabulary (61 slices, two a simdgroup in
the merge), one slice, a last slice smaller than top-k, top-k = n, and ties at the top-k boundary within and beyond the
1024 candidates the kernels hold. Everything again in the ASan/UBSan build, in forward order (test_asan.py), but the
one-threadgroup kernel's decode loop. Each test checks which kernels ran (core.testing.metal_kernels()), so none passes
on the wrong path.
"""
import os
import secrets

import numpy as np
import pytest

from device_sampling import (CONFIGS, DIRECT, N_VALID, PROMPT_LEN, STEPS, VOCAB, check_device_selection,
                             check_direct, select_once)
from lily.tiny import TINY_TEXT_CONFIG, build_tiny

from .conftest import ASAN_CHILD, THREAD_ORDERS

# The kernels that select, by whether sample_split is on.
KERNELS = {True: {"sample_part", "sample_merge"}, False: {"sample"}}


def _tiny(core, vocab, disable=()):
    ckpt = build_tiny(text_config={**TINY_TEXT_CONFIG, "vocab_size": vocab})
    config = {k: v for k, v in ckpt.config.items() if isinstance(v, (int, float, bool))}
    return core.Model(config, ckpt.tensors, ckpt.files, "metal", disable=list(disable))


@pytest.fixture(scope="module")
def model(core):
    """The tiny model with a VOCAB-row lm_head, on the harness's metal backend."""
    return _tiny(core, VOCAB)


# (sample_split on, vocabulary, thread orders): the split over the 12,192 choosable ids of a 12,288-row lm_head (two
# whole slices and a last one of 4,000) in every order, and the one-threadgroup kernel over the tiny model's 4,000 in
# forward order, not in the ASan run (which runs that kernel in the direct selections below): each of these costs
# seconds of forward passes in the harness, ~9 s under ASan, and the suite's time on a 2-core CI is bounded.
SAMPLING_MODELS = {"split, 3 slices": (True, 12288, THREAD_ORDERS),
                   "one threadgroup": (False, VOCAB, () if os.environ.get(ASAN_CHILD) else ("forward",))}
RUNS = [(m, o) for m, (_, _, orders) in SAMPLING_MODELS.items() for o in orders]


@pytest.fixture(scope="module")
def sampling_models(core):
    built = {}

    def get(name):
        if name not in built:
            split, vocab, _ = SAMPLING_MODELS[name]
            built[name] = _tiny(core, vocab, () if split else ("sample_split",)), vocab
        return built[name]
    return get


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("run", RUNS, ids=[f"{m}-{o}" for m, o in RUNS])
def test_device_selection_matches_host_sampler(core, sampling_models, monkeypatch, run, name):
    which, order = run
    model, vocab = sampling_models(which)
    seed = secrets.randbits(64)
    monkeypatch.setenv("LILY_METAL_ORDER", order)
    monkeypatch.setenv("LILY_METAL_SEED", str(seed))
    print(f"order {order}")
    split = SAMPLING_MODELS[which][0]
    before = core.testing.metal_kernels()
    check_device_selection(core, model, name, seed, lambda: core.testing.metal_kernels()[min(KERNELS[split])],
                           vocab=vocab, n_valid=vocab - 96)
    after = core.testing.metal_kernels()
    for kernel in KERNELS[True] | KERNELS[False]:
        ran = after[kernel] - before[kernel]
        assert (ran >= STEPS - 1) if kernel in KERNELS[split] else ran == 0, f"{kernel} ran {ran} times"


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


# ---- direct selections: one Backend::sample on given logits and penalty state ---------------------------------------

def _select(core, split):
    """A selection by the split kernels (split) or the one-threadgroup one, checking which kernels ran."""
    def select(logits, n_valid, params, seed, state):
        before = core.testing.metal_kernels()
        got = select_once(core, "metal", logits, n_valid, params, seed, state, "" if split else "sample_split")
        after = core.testing.metal_kernels()
        assert {k for k in after if after[k] > before[k]} == KERNELS[split]
        return got
    return select


@pytest.mark.parametrize("case", DIRECT)
def test_split_selection_matches_one_threadgroup_and_host(core, monkeypatch, case, thread_order):
    seed = secrets.randbits(63)
    print(f"order {thread_order}, seed {seed}")
    monkeypatch.setenv("LILY_METAL_ORDER", thread_order)
    monkeypatch.setenv("LILY_METAL_SEED", str(seed))
    check_direct(core, case, seed, {"split": _select(core, True), "one threadgroup": _select(core, False)})
