"""The engine behind every API: multi-turn prefix reuse (also across a restart with --cache-dir), the state after a
failed generation, concurrent clients served one at a time, and clients that go away mid-reply."""
import json
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest

import lily
from lily.prefix_cache import PrefixCache
from lily.server import Engine
from live_server import (MAX_CONTEXT, NO_THINKING, LiveServer, Script, chat_body, client_for, last_user, metric,
                         prefix_tokens, words)


def _prompt_ids(model, messages) -> list[int]:
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False))


def test_a_user_turn_prefills_only_the_reply_as_rendered_and_its_new_tokens(server, client, tiny_model):
    """A new user message makes the template drop the reply's thinking block, which the state holds, so the request
    is rendered whole (the prompt is what the template makes of it, whatever was served before). It starts from the
    snapshot taken just after the previous generation prompt's <|im_start|>: only the reply as rendered and the new
    turn are prefilled. The second turn starts from the opening turn's snapshot (the first turn took that one)."""
    messages = [{"role": "system", "content": words(3)}, {"role": "user", "content": words()}]
    before = server.metric("lily_engine_tokens_processed_total")
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=1,
                                           extra_body=NO_THINKING)
    after = server.metric("lily_engine_tokens_processed_total")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert after - before == first.usage.prompt_tokens + first.usage.completion_tokens - 1

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": words()}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=2,
                                            extra_body=NO_THINKING)
    assert second.usage.prompt_tokens == len(_prompt_ids(tiny_model, messages))
    assert second.usage.prompt_tokens_details.cached_tokens == prefix_tokens(tiny_model, messages[:1])

    previous = _prompt_ids(tiny_model, messages)
    cut = max(i for i, t in enumerate(previous) if t == tiny_model.tokenizer.token_to_id("<|im_start|>")) + 1
    messages += [{"role": "assistant", "content": second.choices[0].message.content},
                 {"role": "user", "content": words()}]
    before = server.metric("lily_engine_tokens_processed_total")
    third = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=3,
                                           extra_body=NO_THINKING)
    ids = _prompt_ids(tiny_model, messages)
    assert third.usage.prompt_tokens == len(ids) and ids[:cut] == previous[:cut]
    assert third.usage.prompt_tokens_details.cached_tokens == cut
    work = server.metric("lily_engine_tokens_processed_total") - before
    assert work == (len(ids) - cut) + third.usage.completion_tokens - 1


def test_the_turn_after_a_stop_string_is_prompted_as_the_request_renders(server, client, tiny_model, rng):
    """The state after a reply that a stop string ended holds the stop text, which the client never got: the next
    turn (a tool result, which would otherwise continue that state) is prompted with the conversation rendered whole,
    as a server that never served the first turn would prompt it."""
    messages = [{"role": "user", "content": words()}]
    for _ in range(20):  # a reply with text to stop at
        seed = int(rng.integers(2**31))
        text = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=seed,
                                              extra_body=NO_THINKING).choices[0].message.content or ""
        if len(text) >= 2:
            break
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, seed=seed, stop=[text[:2]],
                                           extra_body=NO_THINKING)
    assert first.choices[0].finish_reason == "stop" and text[:2] not in (first.choices[0].message.content or "")
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "tool", "content": words(3)}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, extra_body=NO_THINKING)
    assert second.usage.prompt_tokens == len(_prompt_ids(tiny_model, messages))


def test_a_new_conversation_starts_from_another_ones_opening_turn(server, client, tiny_model):
    """The opening turn (the system prompt, with the tools an agent's sessions share) is snapshotted on the way: a
    second conversation with the same system prompt prefills only its own messages."""
    system = {"role": "system", "content": words(40)}
    client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": words()}],
                                   max_tokens=2, extra_body=NO_THINKING)
    second = [system, {"role": "user", "content": words()}]
    r = client.chat.completions.create(model="tiny", messages=second, max_tokens=2, extra_body=NO_THINKING)
    assert r.usage.prompt_tokens_details.cached_tokens == prefix_tokens(tiny_model, [system]) > 40


def _start_cli_server(cache_dir: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-m", "lily", "serve", "--model", "tiny", "--port", "0",
                             "--max-context", str(MAX_CONTEXT), "--cache-dir", str(cache_dir),
                             "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # "lily: tiny on cpu (…)" first, then the address
        if match := re.search(r"serving tiny at http://127\.0\.0\.1:(\d+)/v1", line):
            return proc, int(match.group(1))
        seen.append(line)
    proc.kill()
    pytest.fail(f"the server did not start: {''.join(seen)}")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)


def test_restarted_server_resumes_from_its_cache_dir(tmp_path, tiny_model):
    messages = [{"role": "user", "content": words()}]
    proc, port = _start_cli_server(tmp_path)
    try:
        first = client_for(f"http://127.0.0.1:{port}").chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body=NO_THINKING)
    finally:
        _stop(proc)
    assert list(tmp_path.glob("*.lilycache"))

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": words()}]
    proc, port = _start_cli_server(tmp_path)
    try:
        second = client_for(f"http://127.0.0.1:{port}").chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body=NO_THINKING)
        work = metric(port, "lily_engine_tokens_processed_total")
    finally:
        _stop(proc)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == prefix_tokens(tiny_model, messages[:1])
    assert work == (second.usage.prompt_tokens - cached) + second.usage.completion_tokens - 1


# A template that keeps the reasoning of assistant turns, as the real one does inside a tool loop.
REASONING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_a_turn_that_extends_the_reply_continues_from_the_state_after_it(new_tiny_model):
    model = new_tiny_model()
    model.tokenizer.chat_template = REASONING_TEMPLATE
    reply = "Looking it up.\n</think>\n\nIt is sunny."
    script = Script(lambda prompt: reply, feed=True)
    live = LiveServer(Engine(model, max_context=MAX_CONTEXT, cache=PrefixCache(64 << 20, fingerprint="t"),
                             generate_fn=script))
    try:
        client = client_for(live.url)
        messages = [{"role": "user", "content": words()}]
        first = client.chat.completions.create(model="tiny", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": words()}]
        before = live.metric("lily_engine_tokens_processed_total")
        second = client.chat.completions.create(model="tiny", messages=messages)
        work = live.metric("lily_engine_tokens_processed_total") - before
    finally:
        live.close()
    # The reply was fed token by token; the next prompt re-renders it identically, so only what follows its
    # last token (<|im_end|>, the new user turn, the generation prompt) is prefilled.
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens + len(model.tokenizer.encode(reply))
    assert work == (second.usage.prompt_tokens - cached) + second.usage.completion_tokens - 1


def test_a_failed_generation_leaves_a_consistent_state(server, client, script):
    def broken(model, prompt_ids, *, session, sampling, progress=None):
        session.reuse(prompt_ids)
        session.core.prefill(lily.model.as_tokens(prompt_ids[len(session.tokens):]))  # state moves, tokens do not
        raise RuntimeError("backend failure")
        yield

    messages = [{"role": "user", "content": words()}]
    server.engine.generate_fn = broken
    with pytest.raises(openai.InternalServerError, match="backend failure"):
        client.chat.completions.create(model="tiny", messages=messages, extra_body=NO_THINKING)
    session = server.engine.session
    assert session.core.position == len(session.tokens)
    server.engine.generate_fn = script
    script.reply = lambda prompt: "fine"
    r = client.chat.completions.create(model="tiny", messages=messages, extra_body=NO_THINKING)
    assert r.choices[0].message.content == "fine"


def test_eight_concurrent_clients_get_their_own_complete_answers(server, script):
    script.reply = lambda prompt: "echo: " + last_user(prompt)[::-1]
    questions = [f"{i} {words(3)}" for i in range(8)]
    answers, errors = {}, []

    def ask(q: str) -> None:
        try:
            stream = client_for(server.url).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": q}], stream=True, extra_body=NO_THINKING)
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            answers[q] = (text, chunks[-1].choices[0].finish_reason)
        except Exception as e:  # reported below, with the question
            errors.append((q, e))

    threads = [threading.Thread(target=ask, args=(q,)) for q in questions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert answers == {q: ("echo: " + q[::-1], "stop") for q in questions}
    assert script.max_active == 1  # one at a time


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_a_client_killed_mid_reply_does_not_stall_the_next(server, client, script, stream):
    script.reply, script.feed = (lambda prompt: "and so on " * 100), True  # 300 tokens of real decode steps
    before_work = server.metric("lily_engine_tokens_processed_total")
    before_cancelled = server.metric("lily_requests_cancelled_total")
    body = json.dumps(chat_body(messages=[{"role": "user", "content": words()}], max_tokens=250, stream=stream,
                            enable_thinking=False)).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert script.started.wait(timeout=60)
    if stream:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.close()

    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words()}], max_tokens=3,
                                       extra_body=NO_THINKING)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert server.metric("lily_requests_cancelled_total") == before_cancelled + 1
    work = server.metric("lily_engine_tokens_processed_total") - before_work
    second = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens + r.usage.completion_tokens - 1
    assert work - second < 100, "the abandoned generation ran on"
