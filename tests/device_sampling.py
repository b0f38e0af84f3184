"""Token selection on a GPU backend's device against the host sampler (core/sample.cpp, as lily._core.Sampler): the
configurations and the check shared by tests/metal/test_metal_sample.py (the Metal kernel in the CPU harness) and
tests/test_cuda.py (the CUDA kernel).

The model's decode loop runs with device selection (Generator.on_device: the kernel picks each token, records it in
the penalty state and advances the draw counter). A second session of the same model then replays the chosen tokens
to recover the logits each selection saw, and a host Sampler given the same prompt and history must choose the same
token at every step (same rules, same counter-based draw), with the same logprob. The history (ids already in the
session before the prompt, which count for the penalties) is the prompt's most likely next tokens, so that a penalty
the kernel got wrong changes the choice. The vocabulary (4096, of which the first N_VALID may be chosen) is larger
than the kernels' 1024 threads, so each thread scans several ids and the top-k radix selection and the ordered
compaction run as at the real vocabulary.

DIRECT (below) is a table of single selections on given logits (core.testing.run_op "sample"): the real vocabulary,
small and ragged slices, and ties at the top-k boundary within and beyond the kernels' 1024 candidates. Both test
files run each case through every selection kernel of their backend, against each other and the host sampler."""
import numpy as np

import lily

VOCAB = 4096
N_VALID = 4000  # not a multiple of the kernels' 1024 threads
PROMPT_LEN = 6
HISTORY_LEN = 16
STEPS = 6
# name: sampling parameters
CONFIGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=1.0, top_k=1024),  # the most candidates the kernel holds
    "top_k_top_p": dict(temperature=0.8, top_k=40, top_p=0.6),
    "model_default": dict(temperature=1.0, top_k=20, top_p=0.95),  # Qwen3.6's generation_config
    "min_p_penalties": dict(temperature=1.2, top_k=200, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.3,
                            frequency_penalty=0.4),
    # A negative frequency penalty rewards repeats (greedy: net +9 after one use, which the tiny model's logits never
    # overcome), so generated tokens come back and the counts the kernel keeps decide later choices.
    "greedy_penalties": dict(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=-10.0),
    "top_k_penalties": dict(temperature=0.7, top_k=8, repetition_penalty=1.5, presence_penalty=1.0,
                            frequency_penalty=-4.0),
}


def check_device_selection(core, model, name: str, seed: int, selected=None, vocab=VOCAB, n_valid=N_VALID) -> None:
    """CONFIGS[name] with `seed` on `model` (a lily._core.Model whose lm_head has `vocab` rows, the first `n_valid`
    of them choosable): the device's tokens and logprobs against the host sampler's. selected(), if given, counts
    the selection kernel's launches so far."""
    rng = np.random.default_rng(seed)
    params = dict(CONFIGS[name], seed=seed)  # all 64 bits of the draw's seed in play
    prompt = rng.integers(0, n_valid, PROMPT_LEN).astype(np.int32)
    likely = model.session(max_context=64).prefill(prompt)
    history = np.argsort(-likely[:n_valid], kind="stable")[:HISTORY_LEN].astype(np.int32)
    print(f"params {params}, prompt {prompt.tolist()}, history {history.tolist()}")
    replay = model.session(max_context=64)
    replay.prefill(history)
    logits = replay.prefill(prompt)

    session = model.session(max_context=64)
    session.prefill(history)  # already in the session: they count for the penalties
    gen = core.Generator(session, core.SamplingParams(**params), [], STEPS, n_valid)
    assert gen.on_device, f"{name}: the backend should select these tokens on the device"
    gen.prefill(prompt)
    before = selected() if selected else 0
    steps = [gen.next()[:2] for _ in range(STEPS)]  # (token, logprob)
    if selected:
        assert selected() - before >= STEPS - 1, "the sample kernel did not pick the tokens"

    host = lily._core.Sampler(lily._core.SamplingParams(**params), vocab, n_valid)
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


def history_state(rng, logits, n_valid):
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


# Direct selections (core.testing.run_op "sample" on given logits and penalty state; "slices" are those of Metal's
# sample_split, 4096 ids): id: (vocabulary, n_valid, logits, [sampling parameters] (None: CONFIGS with a penalty
# state), host's kept set the same (False: more ties than the kernels' 1024 candidates), seeds a parameter set)
DIRECT = {
    "real vocabulary": (248320, 248077, _normal(248320), None, True, 1),
    "one slice": (VOCAB, N_VALID, _normal(VOCAB), None, True, 1),
    "last slice of 4 ids": (8200, 8196, _normal(8200), [dict(top_k=40), dict(top_k=1024, top_p=0.9)], True,
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


def select_once(core, backend: str, logits, n_valid: int, params: dict, seed: int, state, disable: str = ""):
    """One Backend::sample on `backend` (core.testing.run_op "sample") with the switches `disable` off, from the
    penalty state (counts, seen, step): (token, logprob), after checking the state it leaves (counts, seen, step, the
    token buffer)."""
    counts, seen, step = state
    p = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
             frequency_penalty=0.0)
    p.update(params, seed=seed, n_valid=n_valid, disable=disable)
    out = core.testing.run_op(backend, "sample", p, dict(logits=logits, counts=counts, seen=seen,
                                                         step=np.array([step], np.uint64)))
    slot = out["results"].view(np.int32).reshape(-1, 2)[step % 4]
    token, logprob = int(slot[0]), float(slot[1:].view(np.float32)[0])
    assert 0 <= token < n_valid and out["token"].view(np.int32)[0] == token
    want_counts = counts.copy()
    want_counts[token] += 1
    assert np.array_equal(out["counts"].view(np.int32)[:n_valid], want_counts)
    assert out["seen"].view(np.uint8)[token] == 1 and out["step"].view(np.uint64)[0] == step + 1
    return token, logprob


def check_direct(core, case: str, seed: int, kernels: dict) -> None:
    """DIRECT[case] with `seed`: every parameter set and draw seed through each of `kernels` (name → select(logits,
    n_valid, params, draw_seed, state) → (token, logprob)); all must agree, with the host sampler's token where it
    keeps the same set, and with log_softmax(raw) over [0, n_valid) for the logprob."""
    vocab, n_valid, make, param_sets, host_same, seeds = DIRECT[case]
    rng = np.random.default_rng(seed)
    logits = make(rng)
    prompt, generated = history_state(rng, logits, n_valid) if param_sets is None else ([], [])
    counts = np.bincount(np.array(generated, np.int64), minlength=n_valid).astype(np.int32)
    seen = np.zeros(n_valid, np.uint8)
    seen[prompt + generated] = 1
    state = (counts, seen, len(generated))
    raw = logits[:n_valid].astype(np.float64)
    lse = raw.max() + np.log(np.exp(raw - raw.max()).sum())
    for params in param_sets or CONFIGS.values():
        for _ in range(seeds):
            draw_seed = int(rng.integers(0, 2**64, dtype=np.uint64))
            got = {name: select(logits, n_valid, params, draw_seed, state) for name, select in kernels.items()}
            what = f"{case}, {params}, draw seed {draw_seed}"
            assert len({t for t, _ in got.values()}) == 1, f"{what}: the kernels disagree: {got}"
            token, logprob = next(iter(got.values()))
            assert all(abs(lp - logprob) < 1e-5 for _, lp in got.values()), f"{what}: logprobs {got}"
            host = core.Sampler(core.SamplingParams(**params, seed=draw_seed), vocab, n_valid)
            host.add_prompt(prompt)
            for t in generated:
                host.accept(t)
            if host_same:
                want = host.sample(logits).token
                assert token == want, f"{what}: device chose {token}, host {want}"
            assert abs(logprob - (raw[token] - lse)) < 1e-4, f"{what}: logprob {logprob} != {raw[token] - lse}"
