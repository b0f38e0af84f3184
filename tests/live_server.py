"""A Lily server for tests (tests/server, tests/hostile): run by uvicorn in a thread of the test process on a free
loopback port, with raw-HTTP helpers and `Script`, a generate_fn whose model says what the test chooses.

Tests that need a model whose output they control swap in a Script through the engine's `generate_fn` seam: it
prefills the prompt as lily.stream_generate does, so the engine's state handling stays real, then emits the text
the test chose."""
import http.client
import json
import re
import secrets
import threading

import openai

import lily
from lily.generate import GenerationResponse
from lily.server import BackgroundServer, Engine

MAX_CONTEXT = 320
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city.",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


def words(n: int = 4) -> str:
    """Fresh text per call, so that a test's conversation shares no cached prefix with other tests."""
    return " ".join(secrets.choice(WORDS) for _ in range(n))


def fetch(port: int, method: str, path: str, body=None, headers: dict | None = None) -> tuple[int, dict | str]:
    """(status, JSON body or text) of one request. `body`: a dict (sent as JSON) or raw bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    return resp.status, json.loads(text) if resp.getheader("content-type", "").startswith("application/json") else text


def metric(port: int, name: str) -> float:
    status, text = fetch(port, "GET", "/metrics")
    assert status == 200, text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


class LiveServer(BackgroundServer):
    """A Lily server on a free loopback port, run by uvicorn in a thread of the test process."""

    def __init__(self, engine: Engine, api_key: str | None = None):
        super().__init__(engine, model_id="tiny", api_key=api_key)

    def request(self, method: str, path: str, body=None) -> tuple[int, dict | str]:
        return fetch(self.port, method, path, body)

    def metric(self, name: str) -> float:
        return metric(self.port, name)


def client_for(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=120)


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

    def __call__(self, model, prompt_ids, *, session, sampling, progress=None):
        text = model.tokenizer.decode(prompt_ids)
        self.prompts.append(text)
        self.sampling.append(sampling)
        return self._generate(model, prompt_ids, session, sampling, self.reply(text), progress)

    def _generate(self, model, prompt_ids, session, sampling, reply: str, progress):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            cached = session.reuse(prompt_ids)
            session.prefill(prompt_ids[cached:], progress=progress)
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


def last_user(prompt: str) -> str:
    return re.findall(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", prompt, re.S)[-1]


def prefix_tokens(model, messages) -> int:
    """Tokens of the rendered conversation without a generation prompt: where its last turn ends."""
    return len(model.tokenizer.encode(model.tokenizer.apply_chat_template(messages, add_generation_prompt=False)))


def chat_body(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
