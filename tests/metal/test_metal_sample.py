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

from device_sampling import CONFIGS, N_VALID, PROMPT_LEN, STEPS, VOCAB, check_device_selection
from lily.tiny import TINY_TEXT_CONFIG, build_tiny

from .conftest import ASAN_CHILD, THREAD_ORDERS

SLICE = 4096  # metal/sample_args.h SAMPLE_SLICE
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

def _select(core, logits, n_valid, params, seed, split, state):
    """One device selection by the split kernels (split) or the one-threadgroup one: (token, logprob). Checks the
    kernels dispatched and the state the selection leaves (counts, seen, step)."""
    counts, seen, step = state
    p = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0)
    p.update(params, seed=seed, n_valid=n_valid, disable="" if split else "sample_split")
    before = core.testing.metal_kernels()
    out = core.testing.run_op("metal", "sample", p, dict(logits=logits, counts=counts, seen=seen,
                                                         step=np.array([step], np.uint64)))
    after = core.testing.metal_kernels()
    assert {k for k in after if after[k] > before[k]} == KERNELS[split]
    slot = out["results"].view(np.int32).reshape(-1, 2)[step % 4]
    token, logprob = int(slot[0]), float(slot[1:].view(np.float32)[0])
    assert 0 <= token < n_valid and out["token"].view(np.int32)[0] == token
    want_counts = counts.copy()
    want_counts[token] += 1
    assert np.array_equal(out["counts"].view(np.int32)[:n_valid], want_counts)
    assert out["seen"].view(np.uint8)[token] == 1 and out["step"].view(np.uint64)[0] == step + 1
    return token, logprob


def _history(rng, logits, n_valid):
    """A penalty state that matters: a prompt of 40 random ids (seen) and 12 generated tokens, with repeats, among the
    30 most likely (counts). Returns (prompt, generated)."""
    likely = np.argsort(-logits[:n_valid], kind="stable")[:30]
    return rng.integers(0, n_valid, 40).tolist(), rng.choice(likely, 12).tolist()


def _normal(vocab):
    def make(rng):
        return np.clip(rng.standard_normal(vocab), -5, 5).astype(np.float32) * 2
    return make


def _ties_within_cap(rng):
    """k = 50 with its boundary in a tie of 100 ids spread over the ten slices: the 120 ids at or above it are kept,
    as by the host."""
    x = np.clip(rng.standard_normal(40960), -5, 5).astype(np.float32)
    ids = rng.choice(40864, 120, replace=False)
    x[ids[:20]] = 8 + 0.125 * np.arange(20)
    x[ids[20:]] = 7.0
    return x


def _ties_above_a_slice(rng):
    """Slice 0 holds 2,000 ties at 6 (its own 8th largest, more than the 1,024 candidates) and id 2500 at 8 after them;
    the global top 8 is id 2500 and seven ids at 7 in slices 5 and 7. The slice must hand on id 2500 though 1,024 ties
    come first; top_p = 0.25 then keeps id 2500 alone (the mass above each 7 is 1 of 3.6)."""
    x = np.clip(rng.standard_normal(40960), -5, 5).astype(np.float32)
    x[:2000] = 6.0
    x[2500] = 8.0
    x[[21000, 21001, 21002, 29000, 29001, 29002, 29003]] = 7.0
    return x


def _ties_beyond_the_cap(rng):
    """More ties at the boundary than candidates: slice 0's ids 0–1999 at 6 (id 10 at 9), ids 3000–3002 at 6.5 and
    ten ties in slice 3; k = 8 keeps the first 1,024 ids of the 2,013 at or above 6 (the host keeps all: compared
    kernel against kernel). top_p = 0.021 keeps the ties only if the three 6.5s are rightly left out (the mass above
    a tie is then 1 of 51.9, else 1.25 of 52.0)."""
    x = np.clip(rng.standard_normal(40960), -5, 5).astype(np.float32)
    x[:2000] = 6.0
    x[10] = 9.0
    x[3000:3003] = 6.5
    x[12300:12310] = 6.0
    return x


def _flat(rng):
    return np.zeros(40960, np.float32)


# id: (vocabulary, n_valid, logits, [sampling parameters] (None: CONFIGS with a penalty state), host's kept set the
# same (False: more ties than the kernels' 1024 candidates), seeds a parameter set)
DIRECT = {
    "real vocabulary, 61 slices": (248320, 248077, _normal(248320), None, True, 1),
    "one slice": (VOCAB, N_VALID, _normal(VOCAB), None, True, 1),
    "last slice of 4 ids": (8200, 2 * SLICE + 4, _normal(8200), [dict(top_k=40), dict(top_k=1024, top_p=0.9)], True,
                            3),
    "top-k off, 1000 ids": (1024, 1000, _normal(1024), [dict(temperature=0.7), dict(temperature=1.3, min_p=0.1)],
                            True, 3),
    "ties within the cap": (40960, 40864, _ties_within_cap, [dict(top_k=50), dict(top_k=50, top_p=0.6),
                                                              dict(temperature=0.0)], True, 3),
    "ties above a slice's": (40960, 40864, _ties_above_a_slice, [dict(top_k=8), dict(top_k=8, top_p=0.25)], True, 3),
    "ties beyond the cap": (40960, 40864, _ties_beyond_the_cap, [dict(top_k=8), dict(top_k=8, top_p=0.021),
                                                                 dict(top_k=1024)], False, 4),
    "all tied": (40960, 40864, _flat, [dict(top_k=8), dict(top_k=1024), dict(temperature=0.0)], False, 3),
}


@pytest.mark.parametrize("case", DIRECT)
def test_split_selection_matches_one_threadgroup_and_host(core, monkeypatch, case, thread_order):
    vocab, n_valid, make, param_sets, host_same, seeds = DIRECT[case]
    seed = secrets.randbits(63)
    print(f"order {thread_order}, seed {seed}")
    monkeypatch.setenv("LILY_METAL_ORDER", thread_order)
    monkeypatch.setenv("LILY_METAL_SEED", str(seed))
    rng = np.random.default_rng(seed)
    logits = make(rng)
    prompt, generated = _history(rng, logits, n_valid) if param_sets is None else ([], [])
    counts = np.bincount(np.array(generated, np.int64), minlength=n_valid).astype(np.int32)
    seen = np.zeros(n_valid, np.uint8)
    seen[prompt + generated] = 1
    state = (counts, seen, len(generated))
    raw = logits[:n_valid].astype(np.float64)
    lse = raw.max() + np.log(np.exp(raw - raw.max()).sum())  # the logprob is log_softmax(raw) over [0, n_valid)
    for params in param_sets or CONFIGS.values():
        for draw in range(seeds):
            draw_seed = int(rng.integers(0, 2**64, dtype=np.uint64))
            got = _select(core, logits, n_valid, params, draw_seed, True, state)
            ref = _select(core, logits, n_valid, params, draw_seed, False, state)
            what = f"{case}, {params}, draw seed {draw_seed}"
            assert got[0] == ref[0], f"{what}: split chose {got[0]}, one threadgroup {ref[0]}"
            assert abs(got[1] - ref[1]) < 1e-5, f"{what}: logprob {got[1]} != {ref[1]}"
            host = core.Sampler(core.SamplingParams(**params, seed=draw_seed), vocab, n_valid)
            host.add_prompt(prompt)
            for t in generated:
                host.accept(t)
            want = host.sample(logits)
            if host_same:
                assert got[0] == want.token, f"{what}: device chose {got[0]}, host {want.token}"
            assert abs(got[1] - (raw[got[0]] - lse)) < 1e-4, f"{what}: logprob {got[1]} != {raw[got[0]] - lse}"
