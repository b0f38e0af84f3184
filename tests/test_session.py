"""Session state: chunked prefill, decode, snapshot/restore, multi-turn reuse and refused inputs."""

import numpy as np
import pytest

import lily
from lily import _core


def _ids(rng, model, n) -> np.ndarray:
    return rng.integers(0, model.n_valid, n).astype(np.int32)


def _full_pass(model, tokens) -> np.ndarray:
    """Logits of every position from one forward pass over the whole sequence (a single prefill chunk)."""
    return model.core.session(max_context=len(tokens), prefill_chunk=len(tokens)).forward_all(tokens)


def _assert_same_logits(ours: np.ndarray, ref: np.ndarray, what: str = "") -> None:
    assert ours.shape == ref.shape, what
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert err <= 1e-5 * scale, f"{what}: max|Δ| = {err:.3g}, max|logit| = {scale:.3g}"


def _greedy(model, prompt, session=None, max_tokens=8) -> list[lily.GenerationResponse]:
    return list(lily.stream_generate(model, prompt, session=session, temperature=0.0, max_tokens=max_tokens))


@pytest.fixture
def model_a(oracle_checkpoints) -> lily.Model:
    """For checks of input validation, which do not depend on the geometry."""
    return oracle_checkpoints.model("a")


def test_chunked_prefill_matches_full_pass(model, rng):
    tokens = _ids(rng, model, 72)
    ref = _full_pass(model, tokens)
    for chunk in (1, 7, 64, len(tokens)):
        # forward_all over 65 tokens (64 + 1), then prefill of the last 7 returning the last logits.
        s = model.core.session(max_context=72, prefill_chunk=chunk)
        assert s.prefill_chunk == chunk
        _assert_same_logits(s.forward_all(tokens[:65]), ref[:65], f"forward_all, prefill_chunk {chunk}")
        assert s.position == 65
        _assert_same_logits(s.prefill(tokens[65:]), ref[-1], f"prefill, prefill_chunk {chunk}")
        assert s.position == len(tokens)


def test_decode_token_by_token_matches_full_pass(model, rng):
    tokens = _ids(rng, model, 60)
    ref = _full_pass(model, tokens)
    s = model.core.session(max_context=64, prefill_chunk=16)
    rows = [s.prefill(tokens[:20])]
    for i in range(20, len(tokens)):
        rows.append(s.prefill(tokens[i:i + 1]))
        assert s.position == i + 1
    _assert_same_logits(np.stack(rows), ref[19:])


def test_snapshot_restore_replays_exactly(model, rng):
    head, more, other = _ids(rng, model, 30), _ids(rng, model, 20), _ids(rng, model, 25)
    s = model.core.session(max_context=128, prefill_chunk=16)
    s.prefill(head)
    snap = s.snapshot()
    assert snap.position == 30 and snap.nbytes > 0 and snap.tokens == head.tolist() == s.tokens
    assert snap.on_device  # in the backend's memory (the CPU's is the host's)

    first = s.forward_all(more)
    _assert_same_logits(first, _full_pass(model, np.concatenate([head, more]))[30:])
    s.prefill(other)  # the session moves on; the snapshot must not
    assert s.position == 75 and snap.position == 30

    s.restore(snap)
    assert s.position == 30
    np.testing.assert_array_equal(s.forward_all(more), first)
    s.restore(snap)  # a snapshot restores any number of times
    np.testing.assert_array_equal(s.forward_all(more), first)

    fresh = model.core.session(max_context=128, prefill_chunk=16)
    fresh.restore(snap)
    assert fresh.position == 30 and fresh.tokens == head.tolist()
    np.testing.assert_array_equal(fresh.forward_all(more), first)

    read = _core.Snapshot.from_bytes(snap.to_bytes())  # host memory, the same state
    assert not read.on_device and read.tokens == snap.tokens and read.nbytes == snap.nbytes
    fresh.restore(read)
    np.testing.assert_array_equal(fresh.forward_all(more), first)


# (prefill chunk, position of the snapshot): inside a chunk, at its ends, after the first token, before the last.
@pytest.mark.parametrize("chunk, at", [(16, 21), (16, 32), (16, 6), (64, 45), (64, 63), (7, 40)])
def test_save_at_snapshots_on_the_way(oracle_checkpoints, geometry, rng, chunk, at):
    """save_at: the next prefill takes the snapshot when the state holds `at` tokens, inside its forward passes (each
    GDN layer's conv and scan in two parts there). On the CPU it is, byte for byte, the snapshot of a prefill that
    stopped there, and the prefill's own logits and end state are those of a prefill that took none."""
    model = lily.load(oracle_checkpoints.path(geometry), backend="cpu")
    tokens = _ids(rng, model, 64)
    ref = model.core.session(max_context=64, prefill_chunk=chunk)
    ref.prefill(tokens[:5])
    ref.prefill(tokens[5:at])
    want = ref.snapshot()
    plain = model.core.session(max_context=64, prefill_chunk=chunk)
    plain.prefill(tokens[:5])
    want_logits = plain.prefill(tokens[5:])

    s = model.core.session(max_context=64, prefill_chunk=chunk)
    s.prefill(tokens[:5])
    s.save_at(at)
    np.testing.assert_array_equal(s.prefill(tokens[5:]), want_logits)
    got = s.take_saved()
    assert got is not None and got.position == at and got.tokens == tokens[:at].tolist()
    assert got.to_bytes() == want.to_bytes()
    assert s.snapshot().to_bytes() == plain.snapshot().to_bytes()
    assert s.take_saved() is None  # taken


def test_save_at_lapses_with_the_prefill_that_does_not_reach_it(model, rng):
    tokens = _ids(rng, model, 30)
    s = model.core.session(max_context=64, prefill_chunk=8)
    s.prefill(tokens[:10])
    s.save_at(5)  # behind the state already
    s.prefill(tokens[10:20])
    assert s.take_saved() is None
    s.save_at(25)  # beyond this prefill: it lapses at its end, and the next one passing there takes nothing
    s.prefill(tokens[20:22])
    s.prefill(tokens[22:])
    assert s.take_saved() is None and s.position == 30
    with pytest.raises(ValueError, match="negative"):
        s.save_at(-1)


def test_python_session_snapshot_keeps_tokens(model, rng):
    session = model.session(max_context=128)
    head, more = _ids(rng, model, 12).tolist(), _ids(rng, model, 5).tolist()
    session.prefill(head)
    snap = session.snapshot()
    first = session.prefill(more)
    session.prefill(_ids(rng, model, 7))
    session.restore(snap)
    assert session.tokens == head and session.core.position == 12
    np.testing.assert_array_equal(session.prefill(more), first)
    assert session.tokens == head + more


def test_snapshot_from_other_geometry_is_refused(oracle_checkpoints, rng):
    a, b = oracle_checkpoints.model("a"), oracle_checkpoints.model("b")
    s = a.core.session(max_context=64)
    s.prefill(_ids(rng, a, 10))
    target = b.core.session(max_context=64)
    tokens = _ids(rng, b, 6)
    target.prefill(tokens)
    with pytest.raises(ValueError, match="snapshot"):
        target.restore(s.snapshot())
    assert target.position == 6
    more = _ids(rng, b, 4)
    _assert_same_logits(target.prefill(more), _full_pass(b, np.concatenate([tokens, more]))[-1])


def test_session_reuses_state_for_an_extending_prompt(model, rng):
    session = model.session(max_context=256)
    first = _ids(rng, model, 20).tolist()
    turn1 = _greedy(model, first, session)
    assert turn1[-1].cached_tokens == 0
    generated = [r.token for r in turn1]
    # Every generated token but the last has been fed to the model, so the state holds them too.
    assert session.tokens == first + generated[:-1]

    second = first + generated + _ids(rng, model, 10).tolist()
    turn2 = _greedy(model, second, session)
    assert all(r.cached_tokens == len(first) + len(generated) - 1 for r in turn2)
    assert all(r.prompt_tokens == len(second) for r in turn2)
    scratch = _greedy(model, second)
    assert scratch[-1].cached_tokens == 0
    assert [r.token for r in turn2] == [r.token for r in scratch]
    np.testing.assert_allclose([r.logprob for r in turn2], [r.logprob for r in scratch], atol=1e-4)


def test_session_starts_over_for_a_prompt_that_does_not_extend(model, rng):
    session = model.session(max_context=256)
    first = _ids(rng, model, 20).tolist()
    _greedy(model, first, session)
    # Shares a prefix with the session's tokens but then departs from them.
    other = first[:10] + [(first[10] + 1) % model.n_valid] + _ids(rng, model, 9).tolist()
    turn2 = _greedy(model, other, session)
    assert turn2[-1].cached_tokens == 0
    scratch = _greedy(model, other)
    assert [r.token for r in turn2] == [r.token for r in scratch]
    np.testing.assert_allclose([r.logprob for r in turn2], [r.logprob for r in scratch], atol=1e-4)


def test_prompt_longer_than_context_limit(model_a, rng):
    session = model_a.session(max_context=16)
    assert session.max_context == 16
    with pytest.raises(ValueError, match="prompt of 20 tokens exceeds the context limit of 16 tokens"):
        lily.generate(model_a, _ids(rng, model_a, 20).tolist(), session=session, max_tokens=4)
    with pytest.raises(ValueError, match="context limit of 16"):
        session.prefill(_ids(rng, model_a, 17))
    assert session.core.position == 0 and session.tokens == []

    prompt = _ids(rng, model_a, 8).tolist()
    after = _greedy(model_a, prompt, session, max_tokens=4)
    assert [r.token for r in after] == [r.token for r in _greedy(model_a, prompt, max_tokens=4)]


def test_generation_stops_when_the_context_is_full(oracle_checkpoints, rng):
    model = oracle_checkpoints.new_model("a")
    model.eos_token_ids = []  # only the context limit may end this run
    session = model.session(max_context=16)
    responses = _greedy(model, _ids(rng, model, 10).tolist(), session, max_tokens=20)
    # 10 prompt tokens and 6 fed generated tokens fill the 16 positions; the 7th sampled token cannot be fed.
    assert [r.token >= 0 for r in responses] == [True] * 7 + [False]
    assert responses[-1].finish_reason == "length"
    assert session.core.position == 16


@pytest.mark.parametrize("bad", [-1, "vocab_size", 2**31])
def test_out_of_vocabulary_token_changes_nothing(model_a, rng, bad):
    bad = model_a.vocab_size if bad == "vocab_size" else bad
    head, tail = _ids(rng, model_a, 10), _ids(rng, model_a, 5)
    s = model_a.core.session(max_context=64)
    s.prefill(head)
    session = model_a.session(max_context=64)
    session.prefill(head)

    poisoned = np.concatenate([tail[:3], [bad]]).astype(np.int64)
    if bad < 2**31:  # the core takes int32 ids
        with pytest.raises(ValueError, match=f"token id {bad} at index 3 is outside the vocabulary"):
            s.prefill(poisoned.astype(np.int32))
    with pytest.raises(ValueError, match="token id"):
        session.prefill(poisoned)
    with pytest.raises(ValueError, match="token id"):
        lily.generate(model_a, head.tolist() + poisoned.tolist(), max_tokens=2)
    assert s.position == 10
    assert session.core.position == 10 and session.tokens == head.tolist()

    ref = _full_pass(model_a, np.concatenate([head, tail]))[-1]
    _assert_same_logits(s.prefill(tail), ref)
    _assert_same_logits(session.prefill(tail), ref)


def test_prefill_of_no_tokens_is_refused(model_a, rng):
    s = model_a.core.session(max_context=64)
    s.prefill(_ids(rng, model_a, 5))
    with pytest.raises(ValueError):
        s.prefill(np.zeros(0, dtype=np.int32))
    session = model_a.session(max_context=64)
    with pytest.raises(ValueError):
        session.prefill([])
    assert s.position == 5 and session.core.position == 0


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_continuation_prefills_only_the_new_messages(tiny_model, rng, thinking):
    """A conversation passed back with its reply continues the token stream: only the new turn is prefilled,
    and the state equals a fresh prefill of the same tokens."""
    session = tiny_model.session()
    msgs = [{"role": "user", "content": "Tell me about rivers."}]
    for _ in range(20):  # a reply that <|endoftext|> ends is not continued (tests/test_conversation.py)
        first = list(session.stream_generate(msgs, max_tokens=6, seed=int(rng.integers(2**31)),
                                             enable_thinking=thinking))
        if session.conversation is not None:
            break
    reply = "".join(r.text for r in first)
    held = len(session.tokens)
    msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And lakes?"}]
    second = list(session.stream_generate(msgs, max_tokens=4, temperature=0, enable_thinking=thinking))
    assert second[0].cached_tokens == held > 0
    new_turn = tiny_model.tokenizer.encode(tiny_model.tokenizer.apply_chat_template(
        msgs[-1:], add_generation_prompt=True, enable_thinking=thinking))
    assert second[0].prompt_tokens - second[0].cached_tokens <= len(new_turn) + 4  # the new turn, the reply's end

    # The same token stream from scratch gives the same greedy reply.
    prompt = session.tokens[:second[0].prompt_tokens]
    fresh = [r.token for r in lily.stream_generate(tiny_model, prompt, max_tokens=4, temperature=0)]
    assert fresh == [r.token for r in second]

    # A conversation whose history was edited starts over.
    msgs[0] = {"role": "user", "content": "Tell me about seas."}
    third = list(session.stream_generate(msgs, max_tokens=2, temperature=0, enable_thinking=thinking))
    assert third[0].cached_tokens == 0
