"""Ctrl-C and progress in the Python API: a long prefill reports progress per chunk and stops within one chunk at
KeyboardInterrupt (the core looks for pending signals between chunks, with the GIL released during each), with the
session left holding exactly the tokens read; a generation interrupted or closed while it decodes keeps the reply so
far for the next turn. The command line's side (a terminal, SIGINT) is tests/test_cli_terminal.py."""
import os
import signal
import threading
import time

import numpy as np
import pytest

import lily

CHUNK = 16


@pytest.fixture
def prompt(tiny_model, rng) -> list[int]:
    return rng.integers(0, tiny_model.n_valid, 12 * CHUNK + 5).tolist()


def _interrupt_when(reached: threading.Event, after: float = 0.0) -> threading.Thread:
    """Sends SIGINT to this process (the main thread handles it) once `reached` is set."""
    def run():
        reached.wait(60)
        time.sleep(after)
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_prefill_reports_progress_per_chunk(tiny_model, prompt):
    calls = []
    session = tiny_model.session(prefill_chunk=CHUNK)
    session.prefill(prompt, progress=lambda done, total: calls.append((done, total)))
    n = len(prompt)
    assert calls == [(0, n)] + [(d, n) for d in range(CHUNK, n, CHUNK)] + [(n, n)]
    calls.clear()
    tiny_model.session(prefill_chunk=CHUNK).feed(prompt[:CHUNK], progress=lambda *a: calls.append(a))
    assert calls == [(0, CHUNK), (CHUNK, CHUNK)]  # one chunk: the start and the end only


def test_ctrl_c_stops_a_prefill_within_one_chunk_and_the_session_stays_consistent(tiny_model, prompt):
    session = tiny_model.session(prefill_chunk=CHUNK)
    reached, seen = threading.Event(), []

    def progress(done, total):
        seen.append(done)
        if done == 3 * CHUNK:
            reached.set()  # the signal comes while the core computes the next chunk, with the GIL released

    sender = _interrupt_when(reached)
    with pytest.raises(KeyboardInterrupt):
        session.prefill(prompt, progress=progress)
    sender.join()
    position = session.core.position
    assert position in (3 * CHUNK, 4 * CHUNK), seen  # stopped at the first chunk boundary after the signal
    assert session.tokens == prompt[:position]
    # The state is exactly that of the tokens read: finishing the prompt gives the uninterrupted logits, bit for bit.
    rest = session.prefill(prompt[position:])
    whole = tiny_model.session(prefill_chunk=CHUNK).prefill(prompt)
    np.testing.assert_array_equal(rest, whole)


def test_ctrl_c_without_a_progress_callback(tiny_model, rng):
    t0 = time.perf_counter()
    tiny_model.session(prefill_chunk=CHUNK).feed(rng.integers(0, tiny_model.n_valid, 2 * CHUNK))
    per_chunk = (time.perf_counter() - t0) / 2
    prompt = rng.integers(0, tiny_model.n_valid, CHUNK * max(40, int(3.0 / per_chunk))).tolist()  # 3 s or more
    session = tiny_model.session(prefill_chunk=CHUNK)
    started = threading.Event()
    _interrupt_when(started, after=0.3)
    t0 = time.perf_counter()
    started.set()
    with pytest.raises(KeyboardInterrupt):
        session.feed(prompt)
    elapsed = time.perf_counter() - t0
    position = session.core.position
    assert 0 < position < len(prompt) and position % CHUNK == 0
    assert session.tokens == prompt[:position]
    assert elapsed < 0.3 + 3 * per_chunk + 3.0, (elapsed, position, per_chunk)  # slack for a loaded machine


def test_an_exception_from_the_progress_callback_stops_the_prefill(tiny_model, prompt):
    class Stop(Exception):
        pass

    def progress(done, total):
        if done >= 2 * CHUNK:
            raise Stop(done)

    session = tiny_model.session(prefill_chunk=CHUNK)
    with pytest.raises(Stop):
        session.prefill(prompt, progress=progress)
    assert session.core.position == 2 * CHUNK and session.tokens == prompt[:2 * CHUNK]


def test_generation_interrupted_in_its_prefill_keeps_what_it_read(tiny_model, prompt):
    session = tiny_model.session(prefill_chunk=CHUNK)
    reached = threading.Event()
    _interrupt_when(reached)
    calls = []

    def progress(done, total):
        calls.append((done, total))
        if done == 2 * CHUNK:
            reached.set()

    with pytest.raises(KeyboardInterrupt):
        list(lily.stream_generate(tiny_model, prompt, session=session, max_tokens=4, seed=5, progress=progress))
    position = session.core.position
    assert position in (2 * CHUNK, 3 * CHUNK) and session.tokens == prompt[:position]
    assert session.messages is None
    # The same prompt again reads only the rest, and generates what an uninterrupted run does.
    calls.clear()
    again = list(lily.stream_generate(tiny_model, prompt, session=session, max_tokens=4, seed=5, progress=progress))
    fresh = list(lily.stream_generate(tiny_model, prompt, session=tiny_model.session(prefill_chunk=CHUNK),
                                      max_tokens=4, seed=5))
    assert again[0].cached_tokens == position
    assert [r.token for r in again] == [r.token for r in fresh]
    rest = len(prompt) - position
    assert calls[0] == (0, rest) and calls[-1] == (rest, rest) and len(calls) == 2 + (rest - 1) // CHUNK


def _conversation():
    return [{"role": "user", "content": "Tell me a story"}]


def test_closing_a_chat_generation_keeps_the_reply_so_far(new_tiny_model):
    model = new_tiny_model()
    model.eos_token_ids = []  # the reply must be long enough to stop early
    session = model.session()
    messages = _conversation()
    stream = session.stream_generate(messages, max_tokens=40, seed=2)
    shown = "".join(next(stream).text for _ in range(6))
    stream.close()  # what a consumer does at Ctrl-C (lily chat does so)
    assert session.messages == messages + [{"role": "assistant", "content": shown}]
    assert session.core.position == len(session.tokens)
    # The next turn continues the state: the conversation is not read again.
    held = len(session.tokens)
    follow = messages + [{"role": "assistant", "content": shown}, {"role": "user", "content": "And then?"}]
    first = next(iter(session.stream_generate(follow, max_tokens=2, seed=3)))
    assert first.cached_tokens == held


def test_a_stale_close_does_not_overwrite_a_newer_conversation(new_tiny_model):
    model = new_tiny_model()
    model.eos_token_ids = []
    session = model.session()
    old = session.stream_generate(_conversation(), max_tokens=40, seed=2)
    next(old)
    newer = [{"role": "user", "content": "Something else"}]
    reply = session.generate(newer, max_tokens=3, seed=4)
    old.close()  # late: the session has moved on, and keeps the newer conversation
    assert session.messages == newer + [{"role": "assistant", "content": reply}]


def test_interrupt_inside_a_decode_step_keeps_the_session_consistent(new_tiny_model):
    """KeyboardInterrupt can land anywhere in a step, e.g. after the core returned a token and before the Python
    side recorded it: the core's own list of returned tokens puts session.tokens right."""
    model = new_tiny_model()
    model.eos_token_ids = []
    real = model.tokenizer.detokenizer

    class Interrupting:
        def __init__(self):
            self.inner, self.count = real(), 0

        def add(self, token):
            self.count += 1
            if self.count == 5:
                raise KeyboardInterrupt
            return self.inner.add(token)

        def flush(self):
            return self.inner.flush()

    model.tokenizer.detokenizer = Interrupting
    session = model.session()
    messages = _conversation()
    shown = []
    with pytest.raises(KeyboardInterrupt):
        for r in session.stream_generate(messages, max_tokens=40, seed=2):
            shown.append(r.text)
    assert len(shown) == 4
    assert session.core.position == len(session.tokens)
    prompt_len = len(session.tokens) - 4  # the host loop holds the 5th token back: it is pending
    assert session.conversation.pending is not None and session.tokens[:prompt_len] == model.encode_prompt(messages)
    assert session.messages == messages + [{"role": "assistant", "content": "".join(shown)}]


def test_prefill_off_the_main_thread(tiny_model, prompt):
    """Only the main thread sees signals; another thread's prefill still reports progress when asked (a server's
    worker thread asks for nothing, and its prefill takes no lock between chunks)."""
    calls, results = [], {}

    def work():
        results["plain"] = tiny_model.session(prefill_chunk=CHUNK).prefill(prompt)
        results["reported"] = tiny_model.session(prefill_chunk=CHUNK).prefill(prompt, progress=lambda *a: calls.append(a))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    n = len(prompt)
    assert calls == [(0, n)] + [(d, n) for d in range(CHUNK, n, CHUNK)] + [(n, n)]
    np.testing.assert_array_equal(results["plain"], results["reported"])


def test_interrupt_between_steps_keeps_the_reply(new_tiny_model):
    """KeyboardInterrupt after a step's bookkeeping (here: in the progress callback's last call, which follows the
    first step) records the conversation as the state holds it."""
    model = new_tiny_model()
    model.eos_token_ids = []
    session = model.session()

    def progress(done, total):
        if done == total:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        list(session.stream_generate(_conversation(), max_tokens=40, seed=2, progress=progress))
    assert session.messages[:-1] == _conversation() and session.messages[-1]["role"] == "assistant"
    assert session.core.position == len(session.tokens) and session.conversation.pending is not None  # one token, not yet fed
    reference = model.session().stream_generate(_conversation(), max_tokens=40, seed=2)
    assert session.messages[-1]["content"] == next(reference).text
