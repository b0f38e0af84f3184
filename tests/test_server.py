"""The OpenAI-compatible server (lily.server) against the official `openai` client and raw HTTP, on 127.0.0.1 with
the tiny model: the endpoints, tool calls and reasoning end to end, multi-turn prefix reuse (also across a
restart with --cache-dir), bad requests, concurrent clients and clients that go away mid-stream.

Most tests share one in-process server. Tests that need a model whose output they control swap in a scripted
generator through the engine's `generate_fn` seam: it prefills the prompt as lily.stream_generate does, so the
engine's state handling stays real, then emits the text the test chose."""

import http.client
import json
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
import uvicorn

import lily
from lily.generate import GenerationResponse, stream_generate
from lily.prefix_cache import PrefixCache, model_fingerprint
from lily.server import (Engine, RequestError, create_app, listen, normalize_messages, parse_chat_request,
                         render_chat)

MAX_CONTEXT = 320
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def _words(n: int = 4) -> str:
    """Fresh text per call, so that a test's conversation shares no cached prefix with other tests."""
    return " ".join(secrets.choice(WORDS) for _ in range(n))


def _http(port: int, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict | str]:
    """(status, JSON body or text) of one request. `body`: a dict (sent as JSON) or raw bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, json.loads(text) if resp.getheader("content-type", "").startswith("application/json") else text


def _metric(port: int, name: str) -> float:
    status, text = _http(port, "GET", "/metrics")
    assert status == 200, text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


class LiveServer:
    """A Lily server on a free loopback port, run by uvicorn in a thread of this process."""

    def __init__(self, engine: Engine, api_key: str | None = None):
        self.engine = engine
        sock = listen("127.0.0.1", 0)  # listening already: requests wait in the backlog until uvicorn serves
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(engine, model_id="tiny", api_key=api_key), log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the server did not shut down"

    def request(self, method: str, path: str, body=None) -> tuple[int, dict | str]:
        return _http(self.port, method, path, body)

    def metric(self, name: str) -> float:
        return _metric(self.port, name)


def _client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def server(tiny_model):
    cache = PrefixCache(256 << 20, fingerprint=model_fingerprint(tiny_model))
    live = LiveServer(Engine(tiny_model, max_context=MAX_CONTEXT, cache=cache))
    yield live
    live.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return _client(server.url)


class Script:
    """A generate_fn whose model says `reply(prompt_text)`, then ends with <|im_end|>; it records each call.
    With `feed`, each token is fed back to the model as decoding does; without, the session holds the prompt
    afterwards, as after a one-token reply (the tiny model's decode steps would only cost time)."""

    def __init__(self, reply, feed: bool = False):
        self.reply, self.feed = reply, feed
        self.prompts: list[str] = []
        self.sampling: list[lily.SamplingParams] = []
        self.active = self.max_active = 0
        self.lock = threading.Lock()
        self.started = threading.Event()  # set when a reply begins

    def __call__(self, model, prompt_ids, *, session, sampling):
        text = model.tokenizer.decode(prompt_ids)
        self.prompts.append(text)
        self.sampling.append(sampling)
        return self._generate(model, prompt_ids, session, sampling, self.reply(text))

    def _generate(self, model, prompt_ids, session, sampling, reply: str):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            cached = session.reuse(prompt_ids)
            session.prefill(prompt_ids[cached:])
            ids = model.tokenizer.encode(reply) + [model.eos_token_ids[0]]
            detok = model.tokenizer.detokenizer()
            self.started.set()
            for n, token in enumerate(ids, 1):
                if self.feed and n > 1:
                    session.prefill([ids[n - 2]])
                finish = "stop" if n == len(ids) else "length" if n == sampling.max_tokens else None
                text = "" if token in model.eos_token_ids else detok.add(token)
                if finish:
                    text += detok.flush()
                yield GenerationResponse(text, token, -0.5, [], prompt_tokens=len(prompt_ids), cached_tokens=cached,
                                         generation_tokens=n, finish_reason=finish)
                if finish:
                    return
        finally:
            with self.lock:
                self.active -= 1


@pytest.fixture
def script(server):
    """Makes the shared server's model say what the test sets in `script.reply`."""
    s = Script(lambda prompt: "")
    server.engine.generate_fn = s
    yield s
    server.engine.generate_fn = stream_generate


def _last_user(prompt: str) -> str:
    return re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S)[-1]


def _prefix_tokens(model, messages) -> int:
    """Tokens of the rendered conversation without a generation prompt: where its last turn ends."""
    return len(model.tokenizer.encode(model.tokenizer.apply_chat_template(messages, add_generation_prompt=False)))


# -- the endpoints through the openai client --------------------------------------------------------------

def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").model_extra["max_model_len"] == MAX_CONTEXT
    assert server.request("GET", "/health") == (200, {"status": "ok"})


def test_chat_completion_greedy_with_logprobs(client, tiny_model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": _words()}]
    r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=3, extra_body=NO_THINKING)
    prompt = tiny_model.tokenizer.apply_chat_template(messages, enable_thinking=False)
    assert r.object == "chat.completion" and r.model == "tiny" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == len(tiny_model.tokenizer.encode(prompt))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.tool_calls is None
    entries = choice.logprobs.content
    assert 1 <= r.usage.completion_tokens <= 6
    assert len(entries) == r.usage.completion_tokens - (choice.finish_reason == "stop")
    for e in entries:  # greedy: every token is the most likely one
        assert len(e.top_logprobs) == 3 and e.logprob == e.top_logprobs[0].logprob <= 0
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)


def test_streaming_gives_the_same_answer_as_non_streaming(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": _words()}], temperature=0, max_tokens=8,
                  extra_body=NO_THINKING)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert not chunks[-1].choices and all(c.usage is None for c in chunks[:-1])
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    # The second request found the conversation's first turn in the cache.
    assert 0 < usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens


def test_completions(client, tiny_model):
    prompt = "Once upon a time " + _words()
    whole = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6, logprobs=2, echo=True)
    choice = whole.choices[0]
    assert whole.object == "text_completion" and choice.text.startswith(prompt)
    assert whole.usage.prompt_tokens == len(tiny_model.tokenizer.encode(prompt))
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == whole.usage.completion_tokens - (choice.finish_reason == "stop")
    # Two alternatives may decode to the same text (partial UTF-8 bytes): the legacy format keys them by text.
    assert lp.text_offset[0] == len(prompt) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    streamed = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=6, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text[len(prompt):]
    ids = tiny_model.tokenizer.encode(prompt)
    by_ids = client.completions.create(model="tiny", prompt=ids, temperature=0, max_tokens=6)
    assert by_ids.choices[0].text == choice.text[len(prompt):] and by_ids.usage.prompt_tokens == len(ids)


# -- multi-turn reuse ------------------------------------------------------------------------------------

def test_second_turn_prefills_only_its_new_tokens(server, client, tiny_model):
    messages = [{"role": "system", "content": _words(3)}, {"role": "user", "content": _words()}]
    before = server.metric("lily_engine_tokens_processed_total")
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=1,
                                           extra_body=NO_THINKING)
    after_first = server.metric("lily_engine_tokens_processed_total")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert after_first - before == first.usage.prompt_tokens + first.usage.completion_tokens - 1

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": _words()}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, seed=2,
                                            extra_body=NO_THINKING)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == _prefix_tokens(tiny_model, messages[:2])  # everything up to the first reply
    work = server.metric("lily_engine_tokens_processed_total") - after_first
    assert work == (second.usage.prompt_tokens - cached) + second.usage.completion_tokens - 1


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
    messages = [{"role": "user", "content": _words()}]
    proc, port = _start_cli_server(tmp_path)
    try:
        first = _client(f"http://127.0.0.1:{port}").chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body=NO_THINKING)
    finally:
        _stop(proc)
    assert list(tmp_path.glob("*.lilycache"))

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": _words()}]
    proc, port = _start_cli_server(tmp_path)
    try:
        second = _client(f"http://127.0.0.1:{port}").chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body=NO_THINKING)
        work = _metric(port, "lily_engine_tokens_processed_total")
    finally:
        _stop(proc)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == _prefix_tokens(tiny_model, messages[:1])
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
        client = _client(live.url)
        messages = [{"role": "user", "content": _words()}]
        first = client.chat.completions.create(model="tiny", messages=messages)
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": _words()}]
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


# -- tool calls and reasoning (scripted model output) -------------------------------------------------------

TOOL_REPLY = ("The user wants the forecast, so I call the tool.\n</think>\n\nLet me check.\n\n<tool_call>\n"
              "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
              "</function>\n</tool_call>")


def test_tool_call_round_trip(client, script, tiny_model):
    messages = [{"role": "user", "content": "What's the weather in Paris for two days?"}]
    script.reply = lambda prompt: TOOL_REPLY
    r = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    msg = choice.message
    assert msg.content == "Let me check."
    assert msg.model_extra["reasoning_content"] == "The user wants the forecast, so I call the tool."
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}

    streamed = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], stream=True))
    deltas = [d for c in streamed for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(0, "get_weather", {"city": "Paris", "days": 2})]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Let me check."

    messages += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 18, "sky": "clear"}'}]
    script.reply = lambda prompt: "The tool answered.\n</think>\n\nIt will be 18 °C and clear in Paris."
    r2 = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER])
    assert r2.choices[0].finish_reason == "stop" and r2.choices[0].message.tool_calls is None
    assert r2.choices[0].message.content == "It will be 18 °C and clear in Paris."
    assert '{"temp_c": 18, "sky": "clear"}' in script.prompts[-1]
    assert r2.usage.prompt_tokens_details.cached_tokens == _prefix_tokens(tiny_model, messages[:1])


def test_reasoning_is_separate_and_enable_thinking_is_honoured(client, script):
    script.reply = lambda prompt: "Thinking it over.\n</think>\n\nHello!"
    messages = [{"role": "user", "content": _words()}]
    r = client.chat.completions.create(model="tiny", messages=messages)
    assert (r.choices[0].message.content, r.choices[0].message.model_extra["reasoning_content"]) == \
        ("Hello!", "Thinking it over.")
    assert script.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True))
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == \
        "Thinking it over."

    script.reply = lambda prompt: "Plain answer."
    for extra in (NO_THINKING, {"enable_thinking": False}):
        r = client.chat.completions.create(model="tiny", messages=messages, extra_body=extra)
        assert r.choices[0].message.content == "Plain answer."
        assert r.choices[0].message.model_extra["reasoning_content"] is None
        assert script.prompts[-1].endswith("<think>\n\n</think>\n\n")


def test_request_settings_reach_the_sampler_and_the_template(client, script, tiny_model):
    script.reply = lambda prompt: "ok"
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": "Late rule."},
                                {"role": "developer", "content": "Dev rule."}],
        temperature=0.3, top_p=0.7, presence_penalty=0.5, frequency_penalty=0.25, seed=11, stop=["END", "STOP"],
        max_completion_tokens=9, logprobs=True, top_logprobs=4,
        extra_body={"top_k": 7, "min_p": 0.05, "repetition_penalty": 1.1})
    p = script.sampling[-1]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
            p.repetition_penalty, p.seed, p.stop, p.max_tokens, p.top_logprobs) == \
        (0.3, 0.7, 7, 0.05, 0.5, 0.25, 1.1, 11, ["END", "STOP"], 9, 4)
    # System messages anywhere are merged into one at the start.
    assert script.prompts[-1].startswith("<|im_start|>system\nLate rule.\n\nDev rule.<|im_end|>\n<|im_start|>user\nhi")
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert script.sampling[-1].max_tokens == MAX_CONTEXT - len(tiny_model.tokenizer.encode(script.prompts[-1]))


def test_max_tokens_cuts_the_reply(client, script):
    script.reply = lambda prompt: "one two three four five six seven"
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=3,
                                       extra_body=NO_THINKING)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert "one two three four five six seven".startswith(r.choices[0].message.content)


def test_a_failed_generation_leaves_a_consistent_state(server, client, script):
    def broken(model, prompt_ids, *, session, sampling):
        session.reuse(prompt_ids)
        session.core.prefill(lily.model.as_tokens(prompt_ids[len(session.tokens):]))  # state moves, tokens do not
        raise RuntimeError("backend failure")
        yield

    messages = [{"role": "user", "content": _words()}]
    server.engine.generate_fn = broken
    with pytest.raises(openai.InternalServerError, match="backend failure"):
        client.chat.completions.create(model="tiny", messages=messages, extra_body=NO_THINKING)
    session = server.engine.session
    assert session.core.position == len(session.tokens)
    server.engine.generate_fn = script
    script.reply = lambda prompt: "fine"
    r = client.chat.completions.create(model="tiny", messages=messages, extra_body=NO_THINKING)
    assert r.choices[0].message.content == "fine"


# -- robustness ----------------------------------------------------------------------------------------------

def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


BAD_REQUESTS = [
    ("malformed-json", b'{"model": "tiny", "messages": [', 400, None, None),
    ("not-an-object", b"[1, 2]", 400, None, None),
    ("no-messages", {"model": "tiny"}, 400, "messages", None),
    ("empty-messages", _chat(messages=[]), 400, "messages", None),
    ("bad-role", _chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages[0].role", None),
    ("content-type", _chat(messages=[{"role": "user", "content": 42}]), 400, "messages[0].content", None),
    ("image", _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages[0].content", None),
    ("temperature-string", _chat(temperature="hot"), 400, "temperature", None),
    ("temperature-negative", _chat(temperature=-1), 400, "temperature", None),
    ("top-p-zero", _chat(top_p=0), 400, "top_p", None),
    ("max-tokens-bool", _chat(max_tokens=True), 400, "max_tokens", None),
    ("max-tokens-zero", _chat(max_tokens=0), 400, "max_tokens", None),
    ("stop-empty", _chat(stop=[""]), 400, "stop", None),
    ("n", _chat(n=2), 400, "n", None),
    ("tool-choice-required", _chat(tools=[WEATHER], tool_choice="required"), 400, "tool_choice", None),
    ("bad-tool", _chat(tools=[{"type": "function"}]), 400, "tools[0]", None),
    ("bad-arguments", _chat(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments", None),
    ("top-logprobs-without-logprobs", _chat(top_logprobs=2), 400, "top_logprobs", None),
    ("json-schema", _chat(response_format={"type": "json_object"}), 400, "response_format", None),
    ("thinking-not-bool", _chat(chat_template_kwargs={"enable_thinking": "no"}), 400,
     "chat_template_kwargs.enable_thinking", None),
    ("unknown-model", _chat(model="gpt-4o"), 404, "model", "model_not_found"),
    ("over-long", _chat(messages=[{"role": "user", "content": "word " * MAX_CONTEXT}]), 400, "messages",
     "context_length_exceeded"),
]


@pytest.mark.parametrize("body,status,param,code", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_chat_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, param, code):
    got, err = server.request("POST", "/v1/chat/completions", body)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["type"] == "invalid_request_error"
    assert (err["error"]["param"], err["error"]["code"]) == (param, code)
    assert server.request("POST", "/v1/chat/completions", _chat())[0] == 200


def test_bad_completion_requests_and_routes(server, tiny_model):
    cases = [{"prompt": ["a", "b"]}, {"prompt": [tiny_model.n_valid]}, {"prompt": ""},
             {"prompt": "x", "logprobs": 21}, {"prompt": "x", "suffix": "y"}, {"prompt": "x", "best_of": 2}]
    for body in cases:
        got, err = server.request("POST", "/v1/completions", {"model": "tiny", **body})
        assert got == 400 and err["error"]["message"], (body, err)
    assert server.request("GET", "/v1/nothing")[0] == 404
    assert server.request("GET", "/v1/chat/completions")[0] == 405
    assert server.request("GET", "/v1/models/gpt-4o")[0] == 404
    assert server.request("POST", "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})[0] == 200


def test_openai_client_raises_on_errors(client):
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=3)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])


def test_eight_concurrent_clients_get_their_own_complete_answers(server, script):
    script.reply = lambda prompt: "echo: " + _last_user(prompt)[::-1]
    questions = [f"{i} {_words(3)}" for i in range(8)]
    answers, errors = {}, []

    def ask(q: str) -> None:
        try:
            stream = _client(server.url).chat.completions.create(
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
    body = json.dumps(_chat(messages=[{"role": "user", "content": _words()}], max_tokens=250, stream=stream,
                            enable_thinking=False)).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert script.started.wait(timeout=60)
    if stream:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.close()

    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": _words()}], max_tokens=3,
                                       extra_body=NO_THINKING)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert server.metric("lily_requests_cancelled_total") == before_cancelled + 1
    work = server.metric("lily_engine_tokens_processed_total") - before_work
    second = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens + r.usage.completion_tokens - 1
    assert work - second < 100, "the abandoned generation ran on"


def test_api_key(tiny_model):
    live = LiveServer(Engine(tiny_model, max_context=MAX_CONTEXT), api_key="sekrit")
    try:
        with pytest.raises(openai.AuthenticationError):
            _client(live.url, "wrong").models.list()
        for path in ("/v1/models", "/metrics"):  # no key at all
            status, err = live.request("GET", path)
            assert status == 401 and err["error"]["code"] == "invalid_api_key"
        status, err = live.request("POST", "/v1/chat/completions", _chat())
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
        assert live.request("GET", "/health")[0] == 200
        assert [m.id for m in _client(live.url, "sekrit").models.list().data] == ["tiny"]
    finally:
        live.close()


def test_metrics_exposition(server):
    status, text = server.request("GET", "/metrics")
    assert status == 200
    names = ["lily_requests_total", "lily_requests_cancelled_total", "lily_prompt_tokens_total",
             "lily_prompt_cached_tokens_total", "lily_prefill_tokens_total", "lily_prefill_tokens_per_second",
             "lily_generation_tokens_total", "lily_decode_tokens_per_second", "lily_prefix_cache_hits_total",
             "lily_prefix_cache_misses_total", "lily_prefix_cache_bytes", "lily_engine_tokens_processed_total"]
    for name in names:
        assert f"# TYPE {name} " in text, name
    for line in text.splitlines():
        if not line.startswith("#"):
            assert re.fullmatch(r'lily_\w+(\{[^}]*\})? -?[\d.e+-]+', line), line
    assert re.search(r'^lily_requests_total\{endpoint="/v1/chat/completions",status="200"\} [1-9]', text, re.M)


# -- rendering OpenAI messages with the real template -------------------------------------------------------

def test_openai_history_renders_with_the_real_template(new_tiny_model):
    template = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qwen3.6" / "chat_template.jinja"
    if not template.is_file():
        pytest.skip(f"the real chat template is not at {template}")
    model = new_tiny_model()
    model.tokenizer.chat_template = template.read_text(encoding="utf-8")
    body = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
        {"role": "system", "content": "Be brief."}], "tools": [WEATHER]}
    req = parse_chat_request(body, model)
    assert req.messages[0] == {"role": "system", "content": "Be brief."}
    text = render_chat(model, req)
    assert text.startswith("<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
                           + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>")
    assert "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n" in text
    assert text.endswith(
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n{\"temp\": 18}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert normalize_messages([{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}])[0] == \
        {"role": "system", "content": "d"}
    no_query = parse_chat_request({"messages": [{"role": "assistant", "content": "x"}]}, model)
    with pytest.raises(RequestError, match="No user query found") as err:
        render_chat(model, no_query)
    assert err.value.status == 400 and err.value.param == "messages"


def test_message_without_content_is_refused():
    """As OpenAI's API and the Python API (lily.chat.check_messages): only an assistant turn with tool calls may leave
    its content out."""
    with pytest.raises(RequestError, match=r"'messages\[1\].content' is missing") as err:
        normalize_messages([{"role": "system", "content": "s"}, {"role": "user"}])
    assert err.value.status == 400 and err.value.param == "messages[1].content"
    assert normalize_messages([{"role": "user", "content": "u"}, {"role": "assistant", "content": None,
                                                                  "tool_calls": []}])[1]["content"] == ""
