"""Sampling: lily._core.Sampler against the NumPy reference (lily.sampling), and both against hand-made cases."""

import math

import numpy as np
import pytest

from lily.sampling import SamplingParams, draw_uniform, reference_probs, reference_sample

try:
    from lily import _core
    _why = ""
except ImportError as e:
    _core, _why = None, f"lily._core cannot be imported ({e}): build the package to test the C++ sampler"
needs_core = pytest.mark.skipif(_core is None, reason=_why)

V, N_VALID = 1000, 990              # small vocab with padding rows
QWEN_V, QWEN_N_VALID = 248320, 248077


def random_logits(rng, v, scale=3.0):
    return (rng.standard_normal(v) * scale).astype(np.float32)


def core_sampler(vocab=V, n_valid=N_VALID, prompt=(), generated=(), **kw):
    s = _core.Sampler(_core.SamplingParams(**kw), vocab, n_valid)
    s.add_prompt(list(prompt))
    for t in generated:
        s.accept(t)
    return s


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


# ---- the reference itself --------------------------------------------------------------------------------------

def test_draw_uniform_matches_published_splitmix64():
    # Step 0 is the first output of a splitmix64 stream seeded with `seed` (Vigna's splitmix64.c).
    assert draw_uniform(0, 0) == (0xE220A8397B1DCDAF >> 11) * 2.0**-53
    assert draw_uniform(1234567, 0) == (6457827717110365317 >> 11) * 2.0**-53


def test_from_generation_config():
    qwen = {"do_sample": True, "temperature": 1.0, "top_k": 20, "top_p": 0.95, "eos_token_id": [248046, 248044]}
    p = SamplingParams.from_generation_config(qwen, presence_penalty=1.5, max_tokens=100)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.presence_penalty, p.max_tokens) == (1.0, 20, 0.95, 0.0, 1.5, 100)
    assert SamplingParams.from_generation_config({**qwen, "do_sample": False}).temperature == 0.0
    assert SamplingParams.from_generation_config({**qwen, "do_sample": False}, temperature=0.7).temperature == 0.7
    assert SamplingParams.from_generation_config({}) == SamplingParams()


BAD_PARAMS = [("temperature", -0.1), ("temperature", math.nan), ("top_k", -1), ("top_p", 0.0), ("top_p", 1.01),
              ("min_p", -0.1), ("min_p", 1.5), ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
              ("presence_penalty", math.inf), ("frequency_penalty", math.nan), ("top_logprobs", -1),
              ("top_logprobs", 21)]


@pytest.mark.parametrize("field,value", BAD_PARAMS + [
    ("max_tokens", 0), ("stop", "\n"), ("stop", [""]), ("seed", -1), ("logit_bias", [1, 2]), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {3: 100.5}), ("logit_bias", {3: math.nan}), ("logit_bias", {"3": 1.0}), ("logit_bias", {True: 1.0}),
    ("logit_bias", {i: 1.0 for i in range(1025)}), ("ignore_eos", 1), ("min_tokens", -1)])
def test_python_params_rejected(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


# ---- hand-made cases: exact kept sets, checked on the reference and on the C++ sampler ----------------------------

def both_probs(logits, n_valid, prompt=(), generated=(), **kw):
    """(reference, C++ or None) probs for the same inputs; the reference reads the float32 core params if built."""
    params = _core.SamplingParams(**kw) if _core else SamplingParams(**kw)
    ref = reference_probs(logits, params, list(prompt), list(generated), n_valid)
    got = core_sampler(len(logits), n_valid, prompt, generated, **kw).probs(logits) if _core else None
    return ref, got


def check_against(expected, ref, got):
    np.testing.assert_allclose(ref, expected, rtol=1e-6, atol=1e-12)
    if got is not None:
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_array_equal(got > 0, expected > 0)
        np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-9)


# probs with a tie at the top (ids 1, 4) and at the bottom (ids 0, 5); id 6 is padding with a huge logit.
KNOWN_P = np.array([0.05, 0.3, 0.1, 0.2, 0.3, 0.05])
KNOWN_LOGITS = np.append(np.log(KNOWN_P) + 1.7, 50.0).astype(np.float32)


@pytest.mark.parametrize("kw,kept", [
    (dict(top_k=1), [1, 4]), (dict(top_k=2), [1, 4]), (dict(top_k=3), [1, 3, 4]), (dict(top_k=5), [0, 1, 2, 3, 4, 5]),
    (dict(top_p=0.55), [1, 4]), (dict(top_p=0.65), [1, 3, 4]), (dict(top_p=0.85), [1, 2, 3, 4]),
    (dict(top_p=0.95), [0, 1, 2, 3, 4, 5]),
    (dict(top_k=3, top_p=0.7), [1, 4]), (dict(top_k=3, top_p=0.8), [1, 3, 4]),   # top-p renormalises over top-k
    (dict(min_p=0.9), [1, 4]), (dict(min_p=0.5), [1, 3, 4]), (dict(min_p=0.3), [1, 2, 3, 4]),
    (dict(min_p=0.5, temperature=2.0), [1, 2, 3, 4]),                            # min-p after temperature
    (dict(top_p=0.85, min_p=0.5), [1, 3, 4]), (dict(temperature=0.5), [0, 1, 2, 3, 4, 5]),
])
def test_known_kept_sets(kw, kept):
    w = np.zeros(len(KNOWN_LOGITS))
    w[kept] = KNOWN_P[kept] ** (1.0 / kw.get("temperature", 1.0))
    check_against(w / w.sum(), *both_probs(KNOWN_LOGITS, len(KNOWN_P), **kw))


PENALTY_LOGITS = np.array([2.0, -1.0, 0.5, -3.0, 1.0, 0.0, 4.0, -2.0], np.float32)
PROMPT, GENERATED = [0, 1, 1], [1, 4, 4, 7]


@pytest.mark.parametrize("kw,penalised", [
    (dict(repetition_penalty=2.0), [1.0, -2.0, 0.5, -3.0, 0.5, 0.0, 4.0, -4.0]),      # prompt ∪ generated
    (dict(repetition_penalty=0.5), [4.0, -0.5, 0.5, -3.0, 2.0, 0.0, 4.0, -1.0]),
    (dict(presence_penalty=0.5), [2.0, -1.5, 0.5, -3.0, 0.5, 0.0, 4.0, -2.5]),        # generated only
    (dict(frequency_penalty=0.25), [2.0, -1.25, 0.5, -3.0, 0.5, 0.0, 4.0, -2.25]),    # × count
    (dict(presence_penalty=-1.0, frequency_penalty=1.0), [2.0, -1.0, 0.5, -3.0, 0.0, 0.0, 4.0, -2.0]),
])
def test_each_penalty_with_known_history(kw, penalised):
    expected = np.exp(log_softmax(np.array(penalised) / 0.8))
    check_against(expected, *both_probs(PENALTY_LOGITS, 8, PROMPT, GENERATED, temperature=0.8, **kw))


# ---- C++ sampler against the reference ---------------------------------------------------------------------------

COMBOS = [
    dict(),
    dict(temperature=0.6),
    dict(temperature=1.0, top_k=20, top_p=0.95),                                   # generation_config.json
    dict(temperature=0.7, top_k=20, top_p=0.8, presence_penalty=1.5),              # Qwen non-thinking
    dict(temperature=1.0, top_k=20, top_p=0.95, presence_penalty=1.5),             # Qwen thinking
    dict(top_k=1), dict(top_k=7), dict(top_k=N_VALID), dict(top_k=5000),
    dict(top_p=0.1), dict(top_p=0.5, temperature=1.3), dict(top_p=0.99),
    dict(min_p=0.05), dict(min_p=0.2, temperature=1.5), dict(min_p=1.0),
    dict(top_k=50, top_p=0.9, min_p=0.1, temperature=0.9),
    dict(repetition_penalty=1.3), dict(repetition_penalty=0.7, top_k=40),
    dict(presence_penalty=2.0), dict(frequency_penalty=0.6), dict(frequency_penalty=-0.5, presence_penalty=-0.5),
    dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, top_p=0.7, temperature=0.5),
]


@needs_core
@pytest.mark.parametrize("kw", COMBOS)
def test_probs_match_reference(kw):
    rng = np.random.default_rng(len(str(kw)))
    for _ in range(3):
        logits = random_logits(rng, V)
        prompt, generated = rng.integers(0, N_VALID, 30), rng.integers(0, N_VALID, 25)
        s = core_sampler(prompt=prompt, generated=generated, **kw)
        ref = reference_probs(logits, s.params, prompt, generated, N_VALID)
        got = s.probs(logits)
        np.testing.assert_array_equal(got > 0, ref > 0)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-9)
        assert s.sample(logits).token == reference_sample(logits, s.params, prompt, generated, N_VALID)


@needs_core
@pytest.mark.parametrize("kw", [dict(top_k=30), dict(top_p=0.3), dict(top_p=0.9, temperature=3.0), dict(min_p=0.3),
                                dict(top_k=100, top_p=0.6, min_p=0.1)])
def test_probs_match_reference_with_ties(kw):
    rng = np.random.default_rng(len(str(kw)) + 100)
    for _ in range(3):
        logits = rng.integers(-6, 3, V).astype(np.float32)     # nine distinct values: every boundary is a tie
        s = core_sampler(**kw)
        ref = reference_probs(logits, s.params, [], [], N_VALID)
        got = s.probs(logits)
        np.testing.assert_array_equal(got > 0, ref > 0)
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-9)


@needs_core
@pytest.mark.parametrize("kw", [dict(temperature=1.0, top_k=20, top_p=0.95, presence_penalty=1.5),
                                dict(temperature=0.7, top_p=0.9), dict(min_p=0.02, repetition_penalty=1.2)])
def test_probs_match_reference_full_vocab(kw):
    rng = np.random.default_rng(7)
    logits = random_logits(rng, QWEN_V)
    logits[QWEN_N_VALID:] = 40.0                                # padding rows would win if they were read
    prompt, generated = rng.integers(0, QWEN_N_VALID, 2000), rng.integers(0, QWEN_N_VALID, 300)
    s = core_sampler(QWEN_V, QWEN_N_VALID, prompt, generated, seed=int(rng.integers(2**63)), **kw)
    ref = reference_probs(logits, s.params, prompt, generated, QWEN_N_VALID)
    got = s.probs(logits)
    np.testing.assert_array_equal(got > 0, ref > 0)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-12)
    assert s.sample(logits).token == reference_sample(logits, s.params, prompt, generated, QWEN_N_VALID)


@needs_core
def test_greedy_is_argmax_of_penalised_logits():
    rng = np.random.default_rng(11)
    for _ in range(5):
        logits = random_logits(rng, V)
        s = core_sampler(temperature=0.0, top_k=3, top_p=0.5)
        assert s.sample(logits).token == np.argmax(logits[:N_VALID])
        np.testing.assert_array_equal(s.probs(logits), np.eye(V)[np.argmax(logits[:N_VALID])])
    logits = random_logits(rng, V)
    ids = rng.choice(N_VALID, 3, replace=False)
    logits[ids] = logits.max() + 1.0
    assert core_sampler(temperature=0.0).sample(logits).token == ids.min()               # ties: lowest id
    top = int(np.argmax(logits[:N_VALID]))
    logits[top] = 1.0 + logits[:N_VALID][np.arange(N_VALID) != top].max()
    assert core_sampler(temperature=0.0, generated=[top], presence_penalty=2.0).sample(logits).token != top


@needs_core
def test_seeded_runs_repeat_and_seeds_differ():
    def run(seed):
        rng = np.random.default_rng(3)                           # same logits stream for every run
        s, out = core_sampler(seed=seed, top_k=100, temperature=1.2, frequency_penalty=0.2), []
        for _ in range(40):
            logits = random_logits(rng, V, scale=1.0)
            t = s.sample(logits).token
            assert t == reference_sample(logits, s.params, [], out, N_VALID)
            s.accept(t)
            out.append(t)
        assert s.step == 40
        return out

    seed = int(np.random.default_rng().integers(2**63))
    assert run(seed) == run(seed)
    assert run(seed) != run(seed ^ 1)


@needs_core
def test_empirical_frequencies_match_probs():
    rng = np.random.default_rng(5)
    v, n_valid, draws = 64, 60, 20_000
    logits = random_logits(rng, v, scale=1.0)
    logits[n_valid:] = 30.0
    s = core_sampler(v, n_valid, seed=int(rng.integers(2**63)), top_k=40, top_p=0.97, temperature=0.8)
    p = s.probs(logits).astype(np.float64)
    counts = np.zeros(v)
    for _ in range(draws):
        t = s.sample(logits).token
        counts[t] += 1
        s.accept(t)                                              # advances the counter; no penalties set
    assert counts[p == 0].sum() == 0                             # never outside the kept set (padding included)
    kept = p > 0
    chi2 = ((counts[kept] - draws * p[kept]) ** 2 / (draws * p[kept])).sum()
    dof = kept.sum() - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), f"chi2={chi2:.1f} for {dof} degrees of freedom"


@needs_core
def test_padding_rows_never_chosen():
    rng = np.random.default_rng(13)
    logits = random_logits(rng, V)
    logits[N_VALID:] = 100.0
    for kw in [dict(temperature=0.0), dict(), dict(top_k=5), dict(top_p=0.3), dict(min_p=0.5)]:
        s = core_sampler(top_logprobs=20, **kw)
        assert not s.probs(logits)[N_VALID:].any()
        for _ in range(50):
            r = s.sample(logits)
            assert r.token < N_VALID and max(r.top_ids) < N_VALID
            s.accept(r.token)


@needs_core
def test_logprobs_are_raw_log_softmax_and_top_sorted():
    rng = np.random.default_rng(17)
    logits = random_logits(rng, V)
    logits[[3, 8]] = logits.max() + 0.5                          # a tie at the top: lowest id first
    expected = log_softmax(logits[:N_VALID])
    s = core_sampler(prompt=[3], generated=[8, 8], top_logprobs=5, temperature=0.3, repetition_penalty=1.5,
                     presence_penalty=1.0, seed=int(rng.integers(2**63)))
    r = s.sample(logits)
    assert r.logprob == pytest.approx(expected[r.token], abs=1e-5)
    order = sorted(range(N_VALID), key=lambda i: (-logits[i], i))[:5]
    assert list(r.top_ids) == order and order[:2] == [3, 8]
    np.testing.assert_allclose(r.top_logprobs, expected[order], atol=1e-5)
    assert list(r.top_logprobs) == sorted(r.top_logprobs, reverse=True)
    assert core_sampler().sample(logits).top_ids == []


@needs_core
@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(), dict(top_k=30, top_p=0.8),
                                dict(repetition_penalty=1.3, presence_penalty=0.5, temperature=0.7, min_p=0.05)])
def test_logit_bias_matches_reference(kw):
    """The bias is added to the raw logits first (then penalties, temperature, filters): the C++ sampler against the
    reference, with biases that ban (-100), all but force (+100) and nudge."""
    rng = np.random.default_rng(len(str(kw)) + 7)
    for _ in range(3):
        logits = random_logits(rng, V)
        prompt, generated = rng.integers(0, N_VALID, 30), rng.integers(0, N_VALID, 25)
        ids = rng.choice(N_VALID, 12, replace=False)
        bias = {int(i): float(b) for i, b in zip(ids, [-100, -100, 100] + list(rng.uniform(-5, 5, 9)))}
        if kw.get("temperature") == 0.0 or rng.random() < 0.5:
            bias.pop(int(ids[2]))  # not always a forced token
        params = SamplingParams(**kw, logit_bias=bias, seed=int(rng.integers(2**63)))
        bias_ids, bias_values = params.bias_arrays()
        s = _core.Sampler(params.to_core(), V, N_VALID, bias_ids=bias_ids, bias_values=bias_values)
        s.add_prompt(list(prompt))
        for t in generated:
            s.accept(t)
        ref = reference_probs(logits, params, prompt, generated, N_VALID)
        got = s.probs(logits)
        np.testing.assert_array_equal(got > 0, ref > 1e-30)  # a banned token's e^-100 underflows in float32
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-9)
        assert s.sample(logits).token == reference_sample(logits, params, prompt, generated, N_VALID)
        if int(ids[2]) in bias:
            assert ref[int(ids[2])] > 0.999
        assert ref[int(ids[0])] < 1e-30 and ref[int(ids[1])] < 1e-30


@needs_core
def test_banned_ids_are_never_drawn():
    """Sampler.ban (min_tokens): the banned ids leave the distribution, greedy and sampled, until the next ban()."""
    logits = random_logits(np.random.default_rng(5), V)
    top = [int(i) for i in np.argsort(-logits[:N_VALID])[:3]]
    for kw in (dict(temperature=0.0), dict(top_k=5, seed=3)):
        s = core_sampler(**kw)
        s.ban(top)
        assert np.all(s.probs(logits)[top] == 0) and s.sample(logits).token not in top
        s.ban([])
        assert s.probs(logits)[top[0]] > 0
    with pytest.raises(ValueError, match="ban: token id 990"):
        core_sampler().ban([N_VALID])


@needs_core
@pytest.mark.parametrize("ids,values,match", [([5, 990], [1.0, 1.0], "token id 990 outside"), ([-1], [1.0], "-1"),
                                              ([4, 4], [1.0, 2.0], "token id 4 twice"), ([4], [], "1 ids but 0"),
                                              ([4], [math.inf], "finite")])
def test_core_logit_bias_rejected(ids, values, match):
    with pytest.raises(ValueError, match=f"SamplingParams.logit_bias: .*{match}"):
        _core.Sampler(_core.SamplingParams(), V, N_VALID, bias_ids=ids, bias_values=values)


@needs_core
@pytest.mark.parametrize("field,value", BAD_PARAMS)
def test_core_params_rejected(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        _core.Sampler(_core.SamplingParams(**{field: value}), V, N_VALID)


@needs_core
def test_bad_inputs_rejected():
    with pytest.raises(ValueError, match="n_valid"):
        _core.Sampler(_core.SamplingParams(), V, V + 1)
    s = core_sampler()
    with pytest.raises(ValueError, match="accept: token id 990"):
        s.accept(N_VALID)
    with pytest.raises(ValueError, match="add_prompt: token id -1"):
        s.add_prompt([5, -1])
    with pytest.raises(ValueError, match="logits has 999 entries, expected vocab_size=1000"):
        s.sample(np.random.default_rng(1).standard_normal(V - 1).astype(np.float32))
    logits = random_logits(np.random.default_rng(2), V)
    logits[17] = np.nan
    with pytest.raises(ValueError, match=r"logits\[17\]"):
        s.probs(logits)
    with pytest.raises(ValueError, match="no finite logit"):
        s.sample(np.full(V, -np.inf, np.float32))


@needs_core
def test_to_core_roundtrip_and_random_seed():
    p = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=1.1,
                       presence_penalty=1.5, frequency_penalty=0.25, seed=2**64 - 1, top_logprobs=3)
    c = p.to_core()
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        assert getattr(c, name) == pytest.approx(getattr(p, name), rel=1e-7)
    assert (c.top_k, c.seed, c.top_logprobs) == (20, 2**64 - 1, 3)
    seeds = {SamplingParams().to_core().seed for _ in range(4)}
    assert len(seeds) == 4 and max(seeds) < 2**63
