"""stream_generate / generate on the tiny model: responses, text, sampling seeds, stop conditions, logprobs,
chat templates, verbose output and the GIL."""

import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import lily
from lily.tiny_tokenizer import make_tokenizer_json
from lily.tokenizer import Tokenizer

TEMPLATE_PATH = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qwen3.6" / "chat_template.jinja"


def _prompt(rng, model, n=12) -> list[int]:
    return rng.integers(0, model.n_valid, n).tolist()


def _seed(rng) -> int:
    return int(rng.integers(2**63))


def _run(model, prompt, **kwargs) -> list[lily.GenerationResponse]:
    return list(lily.stream_generate(model, prompt, **kwargs))


def _text(responses) -> str:
    return "".join(r.text for r in responses)


@pytest.fixture
def endless_model(new_tiny_model):
    """A tiny model whose runs end only by max_tokens or a stop string (no EOS ids)."""
    model = new_tiny_model()
    model.eos_token_ids = []
    return model


def test_stream_yields_one_response_per_token(tiny_model, rng):
    prompt = _prompt(rng, tiny_model)
    responses = _run(tiny_model, prompt, max_tokens=10, seed=_seed(rng), top_logprobs=5)
    assert 1 <= len(responses) <= 10
    for i, r in enumerate(responses):
        assert isinstance(r, lily.GenerationResponse)
        assert isinstance(r.text, str)
        assert 0 <= r.token < tiny_model.n_valid
        assert r.generation_tokens == i + 1
        assert r.prompt_tokens == len(prompt) and r.cached_tokens == 0
        assert r.prompt_tps > 0 and r.generation_tps > 0 and r.peak_memory > 0
        assert math.isfinite(r.logprob) and r.logprob <= 0
        assert len(r.top_logprobs) == 5
        ids, lps = zip(*r.top_logprobs)
        assert all(0 <= t < tiny_model.n_valid for t in ids) and len(set(ids)) == 5
        assert list(lps) == sorted(lps, reverse=True) and lps[0] <= 0
        assert r.logprob <= lps[0] + 1e-6
        if r.token in ids:
            assert r.logprob == pytest.approx(lps[ids.index(r.token)], abs=1e-6)
    assert [r.finish_reason for r in responses[:-1]] == [None] * (len(responses) - 1)
    last = responses[-1]
    if last.token in tiny_model.eos_token_ids:
        assert last.finish_reason == "stop"
    else:
        assert last.finish_reason == "length" and len(responses) == 10


def test_text_is_the_decoded_tokens(tiny_model, rng):
    for _ in range(3):
        responses = _run(tiny_model, _prompt(rng, tiny_model), max_tokens=16, seed=_seed(rng))
        ids = [r.token for r in responses if r.token not in tiny_model.eos_token_ids]
        assert _text(responses) == tiny_model.tokenizer.decode(ids)


def test_seeded_sampling_repeats_and_seeds_differ(tiny_model, rng):
    prompt, seed = _prompt(rng, tiny_model), _seed(rng)
    first = _run(tiny_model, prompt, max_tokens=12, seed=seed)
    again = _run(tiny_model, prompt, max_tokens=12, seed=seed)
    assert [(r.token, r.logprob, r.text) for r in first] == [(r.token, r.logprob, r.text) for r in again]
    runs = {tuple(r.token for r in _run(tiny_model, prompt, max_tokens=12, seed=seed + k)) for k in range(1, 4)}
    runs.add(tuple(r.token for r in first))
    assert len(runs) > 1, "four different seeds gave the same tokens"


def test_max_tokens_finishes_with_length(endless_model, rng):
    n = int(rng.integers(3, 9))
    responses = _run(endless_model, _prompt(rng, endless_model), max_tokens=n, seed=_seed(rng))
    assert len(responses) == n
    assert [r.finish_reason for r in responses] == [None] * (n - 1) + ["length"]


def test_default_eos_ids_are_the_tokenizers(tiny_model):
    tok = tiny_model.tokenizer
    assert sorted(tiny_model.eos_token_ids) == sorted([tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])


def test_eos_finishes_with_stop_and_adds_no_text(endless_model, new_tiny_model, rng):
    prompt = _prompt(rng, endless_model)
    free = [r.token for r in _run(endless_model, prompt, temperature=0.0, max_tokens=12)]
    # Declare as EOS the first greedy token that did not occur before it (with a non-empty text of its own).
    k = next((i for i in range(1, len(free)) if free[i] not in free[:i]
              and endless_model.tokenizer.decode([free[i]])), 0)
    model = new_tiny_model()
    model.eos_token_ids = [free[k]]
    responses = _run(model, prompt, temperature=0.0, max_tokens=12)
    assert [r.token for r in responses] == free[:k + 1]
    assert responses[-1].finish_reason == "stop"
    assert _text(responses) == model.tokenizer.decode(free[:k])


def test_ignore_eos_runs_on_to_max_tokens(endless_model, new_tiny_model, rng):
    """vLLM's ignore_eos: an end-of-sequence token is one more token of the reply (its text included), and the reply
    runs to max_tokens; a chat that ran past one is not recorded for continuing (the state holds text after the turn's
    end)."""
    def first_new(tokens):  # a token that did not occur before it: declared EOS, it ends the greedy run there
        return next((i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i]), 0)

    prompt = _prompt(rng, endless_model)
    free = [r.token for r in _run(endless_model, prompt, temperature=0.0, max_tokens=12)]
    k = first_new(free)
    model = new_tiny_model()
    model.eos_token_ids = [free[k]]
    stopped = _run(model, prompt, temperature=0.0, max_tokens=12)
    assert [r.token for r in stopped] == free[:k + 1] and stopped[-1].finish_reason == "stop"
    responses = _run(model, prompt, temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [r.token for r in responses] == free
    assert [r.finish_reason for r in responses] == [None] * 11 + ["length"]
    assert _text(responses) == model.tokenizer.decode(free)

    messages = [{"role": "user", "content": "hi"}]
    session = model.session()
    ids = model.encode_prompt(messages)
    free = [r.token for r in _run(endless_model, ids, temperature=0.0, max_tokens=6)]
    model.eos_token_ids = [free[first_new(free)]]
    assert [r.token for r in _run(model, messages, session=session, temperature=0.0, max_tokens=6,
                                  ignore_eos=True)] == free
    assert session.conversation is None
    model.eos_token_ids = []
    _run(model, messages, session=session, temperature=0.0, max_tokens=6, ignore_eos=True)
    assert session.conversation is not None  # no end-of-sequence token was passed: the reply can be continued


def test_min_tokens_keeps_end_of_sequence_back(endless_model, new_tiny_model, rng):
    """vLLM's min_tokens: no end-of-sequence token among the first min_tokens; the greedy run takes the next best
    token where it would have ended, and may end at an EOS after them."""
    prompt = _prompt(rng, endless_model)
    free = [r.token for r in _run(endless_model, prompt, temperature=0.0, max_tokens=12, top_logprobs=2)]
    k = next((i for i in range(1, 6) if free[i] not in free[:i]), 1)
    model = new_tiny_model()
    model.eos_token_ids = [free[k]]
    held = _run(model, prompt, temperature=0.0, max_tokens=12, min_tokens=k + 3)
    tokens = [r.token for r in held]
    assert tokens[:k] == free[:k] and tokens[k] != free[k]
    assert free[k] not in tokens[:k + 3] and len(tokens) >= k + 3
    assert held[-1].finish_reason == ("stop" if tokens[-1] == free[k] else "length")
    assert _run(model, prompt, temperature=0.0, max_tokens=12, min_tokens=k)[-1].token == free[k]  # the EOS is free


def test_logit_bias_moves_the_choice(endless_model, rng):
    """OpenAI's logit_bias, added to the logits before anything else: -100 bans the greedy token, +100 makes a token
    the greedy choice at every step; the reported logprobs stay those of the raw logits."""
    prompt = _prompt(rng, endless_model)
    free = _run(endless_model, prompt, temperature=0.0, max_tokens=4, top_logprobs=2)
    banned = _run(endless_model, prompt, temperature=0.0, max_tokens=4, logit_bias={free[0].token: -100})
    assert banned[0].token != free[0].token
    forced_id = int(rng.integers(endless_model.n_valid))
    forced = _run(endless_model, prompt, temperature=0.0, max_tokens=4, top_logprobs=2,
                  logit_bias={forced_id: 100})
    assert [r.token for r in forced] == [forced_id] * 4
    assert forced[0].top_logprobs == free[0].top_logprobs  # raw logits: the bias does not show in them
    sampled = _run(endless_model, prompt, temperature=1.0, top_k=0, max_tokens=4, seed=_seed(rng),
                   logit_bias={forced_id: 100})
    assert [r.token for r in sampled] == [forced_id] * 4  # exp(100) outweighs 248K tokens of the tiny model
    with pytest.raises(ValueError, match=r"SamplingParams\.logit_bias: token id .* outside"):
        _run(endless_model, prompt, max_tokens=2, logit_bias={endless_model.n_valid: 1.0})


def test_stop_string_truncates_output(endless_model, rng):
    prompt = _prompt(rng, endless_model)
    full = _text(_run(endless_model, prompt, temperature=0.0, max_tokens=24))
    # A 3-character stop string taken from the middle of the greedy text, so it is sure to appear there.
    start = next(i for i in range(len(full) // 3, len(full) - 3) if "\ufffd" not in full[i:i + 3])
    stop = full[start:start + 3]
    cut = full.find(stop)
    responses = _run(endless_model, prompt, temperature=0.0, max_tokens=24, stop=[stop])
    assert _text(responses) == full[:cut]
    assert responses[-1].finish_reason == "stop"
    assert [r.finish_reason for r in responses[:-1]] == [None] * (len(responses) - 1)

    # Of several stop strings, the earliest match wins.
    early = next(full[i:i + 2] for i in range(1, start) if "\ufffd" not in full[i:i + 2])
    responses = _run(endless_model, prompt, temperature=0.0, max_tokens=24, stop=[stop, early])
    assert _text(responses) == full[:min(cut, full.find(early))]


def test_unfinished_stop_string_is_released(endless_model, rng):
    prompt = _prompt(rng, endless_model)
    full = _text(_run(endless_model, prompt, temperature=0.0, max_tokens=16))
    # The start of this stop string appears (at the very end of the text), the whole never does.
    stop = full[-2:] + "\u2603"
    assert "\u2603" not in full
    responses = _run(endless_model, prompt, temperature=0.0, max_tokens=16, stop=[stop])
    assert _text(responses) == full
    assert responses[-1].finish_reason == "length"


def test_logprobs_match_teacher_forced_logits(tiny_model, rng):
    prompt = _prompt(rng, tiny_model)
    responses = _run(tiny_model, prompt, max_tokens=12, seed=_seed(rng), temperature=0.7, top_logprobs=3)
    generated = [r.token for r in responses]
    logits = tiny_model.logits(prompt + generated[:-1])[len(prompt) - 1:].astype(np.float64)
    # Reported logprobs are of the raw logits (before temperature) over the real vocabulary (padding excluded).
    valid = logits[:, :tiny_model.n_valid]
    logp = valid - (np.log(np.exp(valid - valid.max(1, keepdims=True)).sum(1, keepdims=True))
                    + valid.max(1, keepdims=True))
    np.testing.assert_allclose([r.logprob for r in responses], logp[np.arange(len(generated)), generated], atol=1e-4)
    for r, row in zip(responses, logp):
        ids, lps = zip(*r.top_logprobs)
        assert list(ids) == list(np.argsort(-row, kind="stable")[:3])
        np.testing.assert_allclose(lps, row[list(ids)], atol=1e-4)


def test_chat_messages_go_through_the_template(tiny_model, rng):
    tok = tiny_model.tokenizer
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    seed = _seed(rng)
    for kwargs in ({}, {"enable_thinking": False}):
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs))
        via_messages = _run(tiny_model, messages, max_tokens=6, seed=seed, **kwargs)
        via_ids = _run(tiny_model, ids, max_tokens=6, seed=seed)
        assert via_messages[-1].prompt_tokens == len(ids)
        assert [r.token for r in via_messages] == [r.token for r in via_ids]
    thinking_off = tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
    assert thinking_off.endswith("<think>\n\n</think>\n\n")
    assert thinking_off != tok.apply_chat_template(messages, add_generation_prompt=True)


@pytest.mark.skipif(not TEMPLATE_PATH.is_file(), reason=f"real chat template absent: {TEMPLATE_PATH}")
def test_real_chat_template_with_thinking_off(new_tiny_model, rng):
    model = new_tiny_model()
    model.tokenizer = Tokenizer.from_json(make_tokenizer_json(), chat_template=TEMPLATE_PATH.read_text("utf-8"))
    messages = [{"role": "user", "content": "Hi there"}]
    ids = model.encode_prompt(messages, enable_thinking=False)
    tail = model.tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ids[-len(tail):] == tail
    seed = _seed(rng)
    via_messages = _run(model, messages, max_tokens=4, seed=seed, enable_thinking=False)
    assert via_messages[-1].prompt_tokens == len(ids)
    assert [r.token for r in via_messages] == [r.token for r in _run(model, ids, max_tokens=4, seed=seed)]


def test_generate_verbose_prints_text_and_stats(tiny_model, rng, capsys):
    prompt, seed = _prompt(rng, tiny_model), _seed(rng)
    text = lily.generate(tiny_model, prompt, max_tokens=8, seed=seed, verbose=True)
    out, err = capsys.readouterr()
    assert text == _text(_run(tiny_model, prompt, max_tokens=8, seed=seed))
    assert out == text
    assert f"Prompt: {len(prompt)} tokens" in err
    assert "Generation:" in err and "tok/s" in err and "Peak memory:" in err

    assert lily.generate(tiny_model, prompt, max_tokens=8, seed=seed) == text
    assert capsys.readouterr() == ("", "")


def test_generation_releases_the_gil(oracle_checkpoints, rng):
    model = oracle_checkpoints.model("a")
    prompt = _prompt(rng, model, 400)
    window = {}

    def work():
        window["start"] = time.perf_counter()
        lily.generate(model, prompt, max_tokens=2, temperature=0.0)
        window["end"] = time.perf_counter()

    worker = threading.Thread(target=work)
    stamps = []
    worker.start()
    while worker.is_alive():
        stamps.append(time.perf_counter())
        sum(range(100))  # some Python work that needs the GIL
        time.sleep(0.001)
    worker.join()
    # Most of the run is one prefill call into the core; a held GIL would stall this loop for all of it.
    inside = [t for t in stamps if window["start"] <= t <= window["end"]]
    duration = window["end"] - window["start"]
    gaps = np.diff([window["start"], *inside, window["end"]])
    assert gaps.max() < 0.5 * duration, f"main thread stalled {gaps.max():.3f} s of a {duration:.3f} s generation"
