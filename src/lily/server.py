"""An OpenAI-compatible HTTP server for one model (`lily serve`).

Endpoints: POST /v1/chat/completions and /v1/completions (JSON or server-sent events), GET /v1/models,
/health and /metrics (Prometheus text). One `Engine` owns the model and a single session; a worker thread
runs requests one at a time in arrival order, and a request whose client goes away is cancelled between
tokens. Before each prompt the engine restores the longest cached prefix of it (the live session state or
a `PrefixCache` snapshot), prefills the rest in chunks, and snapshots the state at every turn end
(`<|im_end|>\\n`) inside the prompt and after the reply, so that a conversation re-sent with one more turn
prefills only that turn.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import queue
import re
import socket
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from lily.generate import GenerationResponse, stream_generate
from lily.model import Model
from lily.parsers import MAX_JSON_DEPTH, Delta, OutputParser, prompt_opens_thinking
from lily.prefix_cache import PrefixCache, model_fingerprint
from lily.safetensors_io import CheckpointChangedError
from lily.sampling import INT32_MAX, MAX_TOP_LOGPROBS, SamplingParams

log = logging.getLogger(__name__)

# The largest request body read: a full 262,144-token context is about 1 MB of text (a few MB JSON-escaped).
MAX_BODY_BYTES = 16 << 20
# Turn ends snapshotted per request: the last few past the restored prefix. Later turns of the conversation
# start from one of them (or from the snapshot after the reply); earlier ones were cached by earlier requests.
TURN_SNAPSHOTS = 4
_NUMBER = (int, float)
_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}
_SAMPLING_FIELDS = (("temperature", _NUMBER), ("top_p", _NUMBER), ("top_k", (int,)), ("min_p", _NUMBER),
                    ("presence_penalty", _NUMBER), ("frequency_penalty", _NUMBER),
                    ("repetition_penalty", _NUMBER), ("seed", (int,)))
_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")


# -- errors ------------------------------------------------------------------------------------------------

class RequestError(Exception):
    """A request the server refuses, answered with an OpenAI-style error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _json_type(value) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def _field(body: dict, name: str, kinds: tuple, where: str = ""):
    """body[name] if present and not null (None otherwise), checked against JSON types (a boolean is no number)."""
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        wanted = "a number" if kinds == _NUMBER else " or ".join(_KIND_NAMES[k] for k in kinds)
        raise RequestError(f"'{where}{name}' must be {wanted}, got {_json_type(value)}", param=where + name)
    return value


# -- request bodies ------------------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff written as a JSON escape
_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(data: bytes) -> dict:
    """A request body read as a JSON object; RequestError (400) for anything else, including JSON nested more than
    MAX_JSON_DEPTH levels deep, NaN or Infinity, and strings with a lone UTF-16 surrogate (not Unicode text)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8: {e}") from e
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise RequestError(f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep") \
            from None
    except ValueError as e:
        reason = "a number has more digits than this server reads (4300)" if "integer string" in str(e) else e
        raise RequestError(f"the request body is not valid JSON: {reason}") from e
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_json_type(body)}")
    # Walking the body is linear in its size; these byte scans (C speed) say when it is needed.
    if _nested_too_deep(data) or _SURROGATE_ESCAPE.search(data):
        check_json_value(body, "")
    return body


def _nested_too_deep(data: bytes) -> bool:
    """Whether valid JSON `data` nests arrays and objects more than MAX_JSON_DEPTH levels deep."""
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return False
    brackets = np.frombuffer(_JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS), np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), np.int32(1), np.int32(-1))
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0)) > MAX_JSON_DEPTH


def _printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_json_value(value, where: str) -> None:
    """Refuses a parsed JSON value (a request body, or tool-call arguments read from a string) that nests more than
    MAX_JSON_DEPTH levels deep or holds a string or key with a lone UTF-16 surrogate, naming where."""
    stack = [(value, 1, where)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            if (bad := _SURROGATE.search(item)) is not None:
                raise RequestError(f"'{path}' holds a lone UTF-16 surrogate ({_printable(bad.group())}), which is "
                                   "not Unicode text", param=path)
            continue
        if not isinstance(item, (list, dict)):
            continue
        if depth > MAX_JSON_DEPTH:
            top = where or re.match(r"[^.\[]*(?:\[\d+\])?", path).group()  # e.g. tools[0]
            at = path if len(path) <= 100 else path[:100] + "…"
            raise RequestError(f"'{top}' nests arrays and objects more than {MAX_JSON_DEPTH} levels deep (at {at})",
                               param=top)
        children = []  # pushed in reverse, so that the first problem in reading order is found first
        for k, v in (enumerate(item) if isinstance(item, list) else item.items()):
            if isinstance(k, int):
                children.append((v, depth + 1, f"{path}[{k}]"))
                continue
            name = f"{path}.{_printable(k)}" if path else _printable(k)
            if _SURROGATE.search(k):
                raise RequestError(f"the key '{name}' holds a lone UTF-16 surrogate, which is not Unicode text",
                                   param=name)
            children.append((v, depth + 1, name))
        stack.extend(reversed(children))


# -- requests ------------------------------------------------------------------------------------------------

@dataclass
class Sampling:
    """A request's sampling settings; `max_tokens` None means: as many as the context has room for."""
    params: dict
    max_tokens: int | None

    def build(self, model: Model, room: int) -> SamplingParams:
        max_tokens = room if self.max_tokens is None else min(self.max_tokens, room)
        return SamplingParams.from_generation_config(model.generation_config, **self.params, max_tokens=max_tokens)


def _sampling(body: dict, model: Model, max_token_names: tuple[str, ...], top_logprobs: int) -> Sampling:
    params = {}
    for name, kinds in _SAMPLING_FIELDS:
        value = _field(body, name, kinds)
        if value is not None:
            params[name] = value
    if params.get("top_k") == -1:  # vLLM's spelling of "off"
        params["top_k"] = 0
    stop = body.get("stop")
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("'stop' must be a non-empty string or an array of them", param="stop")
        params["stop"] = stop
    params["top_logprobs"] = top_logprobs
    max_tokens = None
    for name in max_token_names:
        value = _field(body, name, (int,))
        if value is not None:
            if not 1 <= value <= INT32_MAX:
                raise RequestError(f"'{name}' must be in [1, {INT32_MAX}], got {value}", param=name)
            max_tokens = value
            break
    for name, kinds in (("n", (int,)), ("best_of", (int,))):
        value = _field(body, name, kinds)
        if value is not None and value != 1:
            raise RequestError(f"'{name}' must be 1: this server returns one choice per request", param=name)
    if _field(body, "logit_bias", (dict,)):
        raise RequestError("'logit_bias' is not supported", param="logit_bias")
    response_format = _field(body, "response_format", (dict,))
    if response_format is not None and response_format.get("type", "text") != "text":
        raise RequestError(f"response_format {response_format.get('type')!r} is not supported (only 'text': "
                           "Lily does not constrain decoding)", param="response_format")
    sampling = Sampling(params, max_tokens)
    try:
        sampling.build(model, 1)
    except ValueError as e:
        name = re.search(r"SamplingParams\.(\w+)", str(e))
        raise RequestError(str(e).replace("SamplingParams.", ""), param=name.group(1) if name else None) from e
    return sampling


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = bool(_field(body, "stream", (bool,)))
    options = _field(body, "stream_options", (dict,)) or {}
    include_usage = bool(_field(options, "include_usage", (bool,), "stream_options."))
    return stream, include_usage


def _text_content(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _json_type(part)
                raise RequestError(f"'{where}[{j}]': content parts of type {kind!r} are not supported (text only)",
                                   param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"'{where}' must be a string or an array of text parts, got {_json_type(content)}",
                       param=where)


def _history_tool_call(call, where: str) -> dict:
    """An assistant message's OpenAI tool call, with its JSON `arguments` read into a dict for the template."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"'{where}' must be an object with function.name", param=where)
    args = fn.get("arguments", "{}")
    param = where + ".function.arguments"
    if isinstance(args, str):
        try:
            args = json.loads(args, parse_constant=_reject_constant) if args.strip() else {}
        except RecursionError:
            raise RequestError(f"'{param}' nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                               param=param) from None
        except ValueError as e:
            raise RequestError(f"'{param}' is not valid JSON: {e}", param=param) from e
        check_json_value(args, param)
    if not isinstance(args, dict):
        raise RequestError(f"'{param}' must be a JSON object", param=param)
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def normalize_messages(messages) -> list[dict]:
    """OpenAI chat messages as the chat template expects them: text content as strings, tool-call arguments
    as dicts, `developer` read as `system`, and every system message merged into one at the start."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    system, out = [], []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object, got {_json_type(m)}", param=where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"'{where}.role' must be system, developer, user, assistant or tool, got {role!r}",
                               param=where + ".role")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls") is not None):
            raise RequestError(f"'{where}.content' is missing: only an assistant message with tool_calls may leave it "
                               "out", param=where + ".content")  # as OpenAI's API, and lily.chat.check_messages
        content = _text_content(m.get("content"), where + ".content")
        if role in ("system", "developer"):
            system.append(content)
            continue
        msg = {"role": role, "content": content}
        if role == "assistant":
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                if not isinstance(reasoning, str):
                    raise RequestError(f"'{where}.reasoning_content' must be a string", param=where)
                msg["reasoning_content"] = reasoning
            calls = _field(m, "tool_calls", (list,), where + ".")
            if calls:
                msg["tool_calls"] = [_history_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
        elif role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return out


def _tools(body: dict) -> list[dict] | None:
    """The request's tools, or None when there are none or tool_choice is 'none'."""
    if body.get("functions") is not None or body.get("function_call") is not None:
        raise RequestError("'functions' and 'function_call' are deprecated: use 'tools'", param="functions")
    tools = _field(body, "tools", (list,))
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" or \
                not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}",
                               param=f"tools[{i}]")
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise RequestError(f"tool_choice {choice!r} is not supported: only 'auto' and 'none' (Lily does not "
                           "constrain decoding)", param="tool_choice")
    return None if choice == "none" else (tools or None)


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    sampling: Sampling
    stream: bool
    include_usage: bool
    logprobs: bool


def parse_chat_request(body: dict, model: Model) -> ChatRequest:
    """Checks a /v1/chat/completions body; raises RequestError (an OpenAI-style 400) for anything wrong."""
    messages = normalize_messages(body.get("messages"))
    tools = _tools(body)
    kwargs = dict(_field(body, "chat_template_kwargs", (dict,)) or {})
    for name in _RESERVED_TEMPLATE_KWARGS:
        if name in kwargs:
            raise RequestError(f"'chat_template_kwargs' may not set {name!r}", param="chat_template_kwargs")
    thinking = _field(body, "enable_thinking", (bool,))
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    if not isinstance(kwargs.get("enable_thinking", True), bool):
        raise RequestError("'chat_template_kwargs.enable_thinking' must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
    logprobs = bool(_field(body, "logprobs", (bool,)))
    top = _field(body, "top_logprobs", (int,))
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'top_logprobs' must be in 0..{MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs")
    if top and not logprobs:
        raise RequestError("'logprobs' must be true when 'top_logprobs' is set", param="top_logprobs")
    sampling = _sampling(body, model, ("max_completion_tokens", "max_tokens"), top or 0)
    stream, include_usage = _stream_options(body)
    return ChatRequest(messages, tools, kwargs, sampling, stream, include_usage, logprobs)


def render_chat(model: Model, req: ChatRequest) -> str:
    """The prompt text of a chat request (the model's chat template with the generation prompt)."""
    try:
        return model.tokenizer.apply_chat_template(req.messages, tools=req.tools, add_generation_prompt=True,
                                                   **req.template_kwargs)
    except (ValueError, TypeError) as e:
        raise RequestError(f"the conversation cannot be rendered with the model's chat template: {e}",
                           param="messages") from e


@dataclass
class CompletionRequest:
    prompt: str | list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool


def parse_completion_request(body: dict, model: Model) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        bad = [t for t in prompt if not 0 <= t < model.n_valid]
        if bad:
            raise RequestError(f"'prompt' has token id {bad[0]} outside the vocabulary [0, {model.n_valid})",
                               param="prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string or array of token ids (one prompt per request)",
                           param="prompt")
    if _field(body, "suffix", (str,)):
        raise RequestError("'suffix' is not supported", param="suffix")
    logprobs = _field(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'logprobs' must be in 0..{MAX_TOP_LOGPROBS}, got {logprobs}", param="logprobs")
    sampling = _sampling(body, model, ("max_tokens",), logprobs or 0)
    stream, include_usage = _stream_options(body)
    return CompletionRequest(prompt, sampling, stream, include_usage, logprobs, bool(_field(body, "echo", (bool,))))


# -- the engine ------------------------------------------------------------------------------------------

@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str

    def to_openai(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Prompt:
    ids: list[int]
    text: str


class Job:
    """One request for the engine. Its events reach the event loop as (kind, value): ("accepted", Prompt),
    ("token", GenerationResponse) per token, then ("done", Usage) or ("error", RequestError)."""

    def __init__(self, prompt_fn: Callable[[Model], Prompt], sampling: Sampling, prompt_param: str):
        self.prompt_fn, self.sampling, self.prompt_param = prompt_fn, sampling, prompt_param
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: nobody is listening
            self.cancelled.set()

    async def next(self):
        return await self.events.get()

    def cancel(self) -> None:
        self.cancelled.set()


class Metrics:
    """Counters for /metrics, updated by the HTTP layer and the engine thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.cancelled = 0
        self.prompt_tokens = self.cached_tokens = self.prefill_tokens = self.generation_tokens = 0
        self.prefill_seconds = self.decode_seconds = 0.0
        self.last_prefill_tps = self.last_decode_tps = 0.0
        self.prefix_hits = self.prefix_misses = 0

    def count(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[endpoint, status] += 1


GenerateFn = Callable[..., Iterator[GenerationResponse]]


class Engine:
    """The model, its one session and the prefix cache, driven by a worker thread that serves jobs one at a
    time in arrival order. `generate_fn(model, prompt_ids, session=, sampling=)` yields GenerationResponses
    (lily.stream_generate; tests inject scripted generators through it)."""

    def __init__(self, model: Model, *, max_context: int | None = None, cache: PrefixCache | None = None,
                 generate_fn: GenerateFn = stream_generate):
        self.model, self.cache, self.generate_fn = model, cache, generate_fn
        self.session = model.session(max_context)
        self.max_context = self.session.max_context
        self.metrics = Metrics()
        self.running = False
        self._jobs: queue.Queue = queue.Queue()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._token_text: dict[int, str] = {}
        model.tokenizer.min_tokens("")  # reads the vocabulary once, at start-up
        nl = model.tokenizer.encode("\n")
        self._turn_end = (model.tokenizer.token_to_id("<|im_end|>"), nl[0] if len(nl) == 1 else None)

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def start(self) -> None:
        if self._thread is None:
            self._closing = False
            self._thread = threading.Thread(target=self._work, name="lily-engine", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        if self._closing or self._thread is None:
            raise RequestError("the server is shutting down", status=503, kind="server_error")
        self._jobs.put(job)

    def close(self) -> None:
        """Cancels what is queued or running, stops the worker and finishes the cache's disk writes."""
        if self._thread is not None:
            self._closing = True
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        if self.cache is not None:
            self.cache.close()

    def token_text(self, token: int) -> str:
        if token not in self._token_text:
            self._token_text[token] = self.model.tokenizer.decode([token])
        return self._token_text[token]

    # -- worker ----------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._closing or job.cancelled.is_set():
                self._cancelled(job)
                continue
            self.running = True
            error = None
            try:
                self._serve(job)
            except RequestError as e:
                error = e
            except Exception as e:  # a bug or a backend failure: answer 500 and keep serving
                log.exception("request failed")
                error = RequestError(f"internal error: {e}", status=500, kind="server_error")
            self._settle()
            self.running = False
            if error is not None:
                job.emit("error", error)

    def _cancelled(self, job: Job) -> None:
        with self.metrics.lock:
            self.metrics.cancelled += 1
        if self._closing:
            job.emit("error", RequestError("the server is shutting down", status=503, kind="server_error"))
        else:  # the client went away: nobody reads this
            job.emit("error", RequestError("cancelled", status=499))

    def check_prompt_length(self, n: int, param: str, *, at_least: bool = False) -> None:
        """Refuses a prompt of `n` tokens (or more, `at_least`) that leaves no room to generate."""
        if n >= self.max_context:
            raise RequestError(f"This model's maximum context length is {self.max_context} tokens, and the prompt "
                               f"has {'at least ' if at_least else ''}{n} tokens (at least one must be left to "
                               "generate).", param=param, code="context_length_exceeded")

    def check_prompt_text(self, text: str, param: str) -> None:
        """Refuses a prompt text that surely has too many tokens, without tokenising it (Tokenizer.min_tokens: a
        linear-time lower bound), so that an absurdly long prompt never reaches the worker. Thread-safe."""
        if len(text) >= self.max_context:  # shorter texts are checked exactly, by the worker
            self.check_prompt_length(self.model.tokenizer.min_tokens(text), param, at_least=True)

    def _serve(self, job: Job) -> None:
        try:
            self.model.check_files()  # a weights file overwritten under the model: refuse, do not crash
        except CheckpointChangedError as e:
            raise RequestError(str(e), status=503, kind="server_error") from e
        prompt = job.prompt_fn(self.model)
        n = len(prompt.ids)
        if n == 0:
            raise RequestError("the prompt is empty", param=job.prompt_param)
        self.check_prompt_length(n, job.prompt_param)
        params = job.sampling.build(self.model, self.max_context - n)
        job.emit("accepted", prompt)
        t0 = time.perf_counter()
        cached = self._prepare(prompt.ids, job)
        if cached is None:
            self._cancelled(job)
            return
        t_first = t_end = None
        last: GenerationResponse | None = None
        stream = self.generate_fn(self.model, prompt.ids, session=self.session, sampling=params)
        try:
            for r in stream:
                t_end = time.perf_counter()
                t_first = t_first or t_end
                if self._closing or job.cancelled.is_set():
                    break
                last = r
                job.emit("token", r)
        finally:
            stream.close()
        if last is None or last.finish_reason is None:
            self._cancelled(job)
            return
        usage = Usage(n, cached, last.generation_tokens, last.finish_reason)
        self._record(usage, t_first - t0, t_end - t_first)  # before the response ends: a scrape after it sees it
        job.emit("done", usage)
        self._remember()  # the state after the reply: the next turn may extend it

    def _turn_ends(self, ids: list[int]) -> list[int]:
        """Positions just after each `<|im_end|>\\n` in `ids`: where a chat turn ends."""
        im_end, nl = self._turn_end
        if im_end is None or len(ids) < 2:
            return []
        a = np.asarray(ids)
        if nl is None:
            return (np.nonzero(a == im_end)[0] + 1).tolist()
        return (np.nonzero((a[:-1] == im_end) & (a[1:] == nl))[0] + 2).tolist()

    def _prepare(self, ids: list[int], job: Job) -> int | None:
        """Brings the session to ids[:-1]: from the longest saved prefix (the live state or a cached snapshot),
        prefilling the rest in chunks and snapshotting at the last TURN_SNAPSHOTS turn ends. Returns how many
        tokens came from saved state, or None if the job was cancelled meanwhile."""
        s, n = self.session, len(ids)
        held = len(s.tokens)
        live = held if 0 < held < n and s.tokens == ids[:held] else 0
        hit = self.cache.lookup(ids, longer_than=live) if self.cache is not None else None
        if hit is not None:
            s.restore(hit)
        elif live == 0:
            s.reset()
        cached = pos = len(s.tokens)
        turn_ends = set([b for b in self._turn_ends(ids) if pos < b < n][-TURN_SNAPSHOTS:])
        chunk = s.core.prefill_chunk
        for end in sorted(turn_ends | {n - 1}):
            while pos < end:
                if self._closing or job.cancelled.is_set():
                    return None
                step = min(end, pos + chunk)
                s.feed(ids[pos:step])  # no logits: nobody reads them (the generation prefills the last token)
                pos = step
            if end in turn_ends:
                self._remember()
        return cached

    def _remember(self) -> None:
        """Caches a snapshot of the session, keyed by its tokens, if they match its state."""
        s = self.session
        if self.cache is not None and s.tokens and s.core.position == len(s.tokens):
            snapshot, tokens = s.snapshot()
            self.cache.insert(tokens, snapshot)

    def _settle(self) -> None:
        """After any request: a session whose tokens do not describe its state (a failure mid-step) starts over."""
        s = self.session
        if s.core.position != len(s.tokens):
            log.warning("session state and tokens disagree after a request; resetting the session")
            s.reset()

    def _record(self, usage: Usage, prefill_s: float, decode_s: float) -> None:
        m, prefilled = self.metrics, usage.prompt_tokens - usage.cached_tokens
        with m.lock:
            m.prompt_tokens += usage.prompt_tokens
            m.cached_tokens += usage.cached_tokens
            m.prefill_tokens += prefilled
            m.generation_tokens += usage.completion_tokens
            m.prefill_seconds += prefill_s
            m.decode_seconds += decode_s
            m.last_prefill_tps = prefilled / max(prefill_s, 1e-9)
            m.last_decode_tps = (usage.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0
            if usage.cached_tokens:
                m.prefix_hits += 1
            else:
                m.prefix_misses += 1


def render_metrics(engine: Engine) -> str:
    """Prometheus text exposition of the engine's counters."""
    m, cache = engine.metrics, engine.cache
    lines = []

    def metric(name: str, kind: str, help_text: str, samples) -> None:
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"))
        for labels, value in samples:
            lines.append(f"{name}{labels} {value}")

    with m.lock:
        metric("lily_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
               [(f'{{endpoint="{e}",status="{s}"}}', c) for (e, s), c in sorted(m.requests.items())])
        metric("lily_requests_cancelled_total", "counter", "Requests cancelled (client gone) before finishing.",
               [("", m.cancelled)])
        metric("lily_requests_running", "gauge", "Requests being generated now.", [("", int(engine.running))])
        metric("lily_requests_queued", "gauge", "Requests waiting for the engine.", [("", engine.queued)])
        metric("lily_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", m.prompt_tokens)])
        metric("lily_prompt_cached_tokens_total", "counter", "Prompt tokens restored from saved state, not prefilled.",
               [("", m.cached_tokens)])
        metric("lily_prefill_tokens_total", "counter", "Prompt tokens prefilled.", [("", m.prefill_tokens)])
        metric("lily_prefill_seconds_total", "counter", "Time to first token, summed.", [("", m.prefill_seconds)])
        metric("lily_generation_tokens_total", "counter", "Tokens generated.", [("", m.generation_tokens)])
        metric("lily_decode_seconds_total", "counter", "Time from first to last token, summed.",
               [("", m.decode_seconds)])
        metric("lily_prefill_tokens_per_second", "gauge", "Prefill throughput of the last request.",
               [("", m.last_prefill_tps)])
        metric("lily_decode_tokens_per_second", "gauge", "Decode throughput of the last request.",
               [("", m.last_decode_tps)])
        metric("lily_prefix_cache_hits_total", "counter", "Prompts that started from saved state.",
               [("", m.prefix_hits)])
        metric("lily_prefix_cache_misses_total", "counter", "Prompts prefilled from the start.",
               [("", m.prefix_misses)])
    metric("lily_engine_tokens_processed_total", "counter", "Tokens the engine's session ran through the model "
           "(prefill and decode).", [("", engine.session.core.tokens_processed)])
    if cache is not None:
        metric("lily_prefix_cache_snapshots", "gauge", "Snapshots held in memory.", [("", cache.entries)])
        metric("lily_prefix_cache_bytes", "gauge", "Bytes of snapshots held in memory.", [("", cache.bytes)])
        metric("lily_prefix_cache_evictions_total", "counter", "Snapshots evicted from memory.",
               [("", cache.evictions)])
        metric("lily_prefix_cache_disk_snapshots", "gauge", "Snapshots on disk.", [("", cache.disk_entries)])
        metric("lily_prefix_cache_disk_bytes", "gauge", "Bytes of snapshots on disk.", [("", cache.disk_bytes)])
    return "\n".join(lines) + "\n"


# -- HTTP ------------------------------------------------------------------------------------------------

def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _cancel_on_disconnect(request, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancel()


class _Api:
    """The request handlers of one app."""

    def __init__(self, engine: Engine, model_id: str, api_key: str | None):
        self.engine, self.model_id, self.api_key = engine, model_id, api_key
        self.created = int(time.time())

    def endpoint(self, name: str, handler, protected: bool = True):
        async def run(request):
            try:
                if protected and not self._authorized(request):
                    raise RequestError("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                       status=401, code="invalid_api_key")
                response = await handler(request)
            except RequestError as e:
                response = e.response()
            except Exception as e:
                log.exception("%s failed", name)
                response = RequestError(f"internal error: {e}", status=500, kind="server_error").response()
            self.engine.metrics.count(name, response.status_code)
            return response
        return run

    def _authorized(self, request) -> bool:
        if self.api_key is None:
            return True
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key.encode())

    async def _body(self, request) -> dict:
        too_long = RequestError(f"the request body exceeds {MAX_BODY_BYTES} bytes", status=413)
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise too_long
        data = bytearray()
        async for piece in request.stream():
            data += piece
            if len(data) > MAX_BODY_BYTES:
                raise too_long
        # A large body is parsed off the event loop, so that other streams go on meanwhile.
        body = parse_body(bytes(data)) if len(data) < 1 << 20 else await asyncio.to_thread(parse_body, bytes(data))
        model = _field(body, "model", (str,))
        if model is not None and model != self.model_id:
            raise RequestError(f"the model '{model}' does not exist: this server serves '{self.model_id}'",
                               status=404, param="model", code="model_not_found")
        return body

    async def _start(self, request, job: Job):
        """Submits a job; returns (its Prompt, the disconnect watcher) once the engine accepted it."""
        self.engine.submit(job)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        try:
            kind, value = await job.next()
        except BaseException:
            watcher.cancel()
            job.cancel()
            raise
        if kind == "error":
            watcher.cancel()
            raise value
        return value, watcher

    # -- endpoints -------------------------------------------------------------------------------------------

    async def health(self, request):
        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        return PlainTextResponse(render_metrics(self.engine), media_type="text/plain; version=0.0.4")

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "lily",
                "max_model_len": self.engine.max_context}

    async def models(self, request):
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request):
        if request.path_params["model"] != self.model_id:
            raise RequestError(f"the model '{request.path_params['model']}' does not exist", status=404,
                               param="model", code="model_not_found")
        return JSONResponse(self._model_card())

    async def chat(self, request):
        model = self.engine.model
        req = parse_chat_request(await self._body(request), model)

        def render() -> str:
            text = render_chat(model, req)
            self.engine.check_prompt_text(text, "messages")
            return text

        text = await asyncio.to_thread(render)  # a long conversation renders off the event loop, not in the worker
        job = Job(lambda m: Prompt(m.tokenizer.encode(text), text), req.sampling, "messages")
        prompt, watcher = await self._start(request, job)
        parser = OutputParser(reasoning=prompt_opens_thinking(prompt.text), tools=req.tools)
        rid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        if req.stream:
            return self._stream(self._chat_chunks(req, job, parser, rid, created), job, watcher)
        try:
            out, logprobs = Delta(), []
            while True:
                kind, value = await job.next()
                if kind == "token":
                    out += parser.feed(value.text)
                    logprobs += self._chat_logprobs(value) if req.logprobs else []
                elif kind == "done":
                    out += parser.finish()
                    break
                else:
                    raise value
        finally:
            watcher.cancel()
            job.cancel()
        message = {"role": "assistant", "content": out.content or (None if out.tool_calls else ""),
                   "reasoning_content": out.reasoning or None}
        if out.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in out.tool_calls]
        choice = {"index": 0, "message": message, "logprobs": {"content": logprobs} if req.logprobs else None,
                  "finish_reason": _finish(value, out)}
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.model_id,
                             "choices": [choice], "usage": value.to_openai()})

    async def _chat_chunks(self, req: ChatRequest, job: Job, parser: OutputParser, rid: str, created: int):
        def chunk(delta: dict, finish: str | None = None, logprobs=None) -> str:
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_id,
                 "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if req.include_usage:
                c["usage"] = None
            return _sse(c)

        yield chunk({"role": "assistant", "content": ""})
        calls = Delta()
        while True:
            kind, value = await job.next()
            if kind == "error":
                yield _sse(value.body())
                return
            d = parser.feed(value.text) if kind == "token" else parser.finish()
            delta = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.content:
                delta["content"] = d.content
            if d.tool_calls:
                delta["tool_calls"] = [c.to_openai(len(calls.tool_calls) + i) for i, c in enumerate(d.tool_calls)]
                calls += d
            logprobs = None
            if kind == "token" and req.logprobs and (entries := self._chat_logprobs(value)):
                logprobs = {"content": entries}
            if delta or logprobs:
                yield chunk(delta, logprobs=logprobs)
            if kind == "done":
                yield chunk({}, _finish(value, calls))
                if req.include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": self.model_id, "choices": [], "usage": value.to_openai()})
                yield "data: [DONE]\n\n"
                return

    def _chat_logprobs(self, r: GenerationResponse) -> list[dict]:
        if not self._reported(r):
            return []

        def entry(token: int, logprob: float) -> dict:
            text = self.engine.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top_logprobs]}]

    def _reported(self, r: GenerationResponse) -> bool:
        """Whether a generated token is part of the answer (an end-of-sequence token is not)."""
        return r.token >= 0 and not (r.finish_reason == "stop" and r.token in self.engine.model.eos_token_ids)

    async def completions(self, request):
        model = self.engine.model
        req = parse_completion_request(await self._body(request), model)
        if isinstance(req.prompt, str):
            await asyncio.to_thread(self.engine.check_prompt_text, req.prompt, "prompt")
            job = Job(lambda m: Prompt(m.tokenizer.encode(req.prompt), req.prompt), req.sampling, "prompt")
        else:
            job = Job(lambda m: Prompt(list(req.prompt), m.tokenizer.decode(req.prompt)), req.sampling, "prompt")
        prompt, watcher = await self._start(request, job)
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        echo = prompt.text if req.echo else ""
        if req.stream:
            return self._stream(self._completion_chunks(req, job, echo, rid, created), job, watcher)
        try:
            text, lp = [echo], _CompletionLogprobs(len(echo)) if req.logprobs is not None else None
            while True:
                kind, value = await job.next()
                if kind == "token":
                    text.append(value.text)
                    if lp is not None and self._reported(value):
                        lp.add(self.engine, value)
                elif kind == "done":
                    break
                else:
                    raise value
        finally:
            watcher.cancel()
            job.cancel()
        choice = {"index": 0, "text": "".join(text), "logprobs": lp.to_openai() if lp else None,
                  "finish_reason": value.finish_reason}
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.model_id,
                             "choices": [choice], "usage": value.to_openai()})

    async def _completion_chunks(self, req: CompletionRequest, job: Job, echo: str, rid: str, created: int):
        def chunk(text: str, finish: str | None = None, logprobs=None) -> str:
            c = {"id": rid, "object": "text_completion", "created": created, "model": self.model_id,
                 "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            if req.include_usage:
                c["usage"] = None
            return _sse(c)

        if echo:
            yield chunk(echo)
        offset = len(echo)
        while True:
            kind, value = await job.next()
            if kind == "error":
                yield _sse(value.body())
                return
            if kind == "done":
                yield chunk("", value.finish_reason)
                if req.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_id,
                                "choices": [], "usage": value.to_openai()})
                yield "data: [DONE]\n\n"
                return
            lp = None
            if req.logprobs is not None and self._reported(value):
                lp = _CompletionLogprobs(offset)
                lp.add(self.engine, value)
            offset += len(value.text)
            if value.text or lp:
                yield chunk(value.text, logprobs=lp.to_openai() if lp else None)

    def _stream(self, chunks, job: Job, watcher) -> StreamingResponse:
        async def body():
            try:
                async for piece in chunks:
                    yield piece
            finally:  # also when the client went away and the response task is cancelled
                watcher.cancel()
                job.cancel()

        return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _finish(usage: Usage, out: Delta) -> str:
    return "tool_calls" if out.tool_calls and usage.finish_reason == "stop" else usage.finish_reason


class _CompletionLogprobs:
    """The legacy completions `logprobs` object, built token by token."""

    def __init__(self, offset: int):
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self.offset = offset

    def add(self, engine: Engine, r: GenerationResponse) -> None:
        self.tokens.append(engine.token_text(r.token))
        self.token_logprobs.append(r.logprob)
        self.top_logprobs.append({engine.token_text(t): lp for t, lp in r.top_logprobs})
        self.text_offset.append(self.offset)
        self.offset += len(r.text)

    def to_openai(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}


def create_app(engine: Engine, *, model_id: str, api_key: str | None = None):
    """The Starlette app of an engine. Its lifespan starts the engine's worker and closes the engine."""
    api = _Api(engine, model_id, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    async def http_error(request, exc: HTTPException):
        err = RequestError(exc.detail, status=exc.status_code, code="not_found" if exc.status_code == 404 else None)
        engine.metrics.count(request.url.path if exc.status_code != 404 else "other", exc.status_code)
        return err.response()

    routes = [
        Route("/v1/chat/completions", api.endpoint("/v1/chat/completions", api.chat), methods=["POST"]),
        Route("/v1/completions", api.endpoint("/v1/completions", api.completions), methods=["POST"]),
        Route("/v1/models", api.endpoint("/v1/models", api.models), methods=["GET"]),
        Route("/v1/models/{model:path}", api.endpoint("/v1/models", api.model), methods=["GET"]),
        Route("/health", api.endpoint("/health", api.health, protected=False), methods=["GET"]),
        Route("/metrics", api.endpoint("/metrics", api.metrics), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=128)


def serve(model: Model, *, model_id: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_context: int | None = None, cache_bytes: int = 4 << 30, cache_dir: str | None = None,
          cache_disk_bytes: int | None = None, log_level: str = "info") -> None:
    """Serves `model` over HTTP until interrupted (SIGINT / SIGTERM)."""
    cache = None
    if cache_bytes > 0 or cache_dir is not None:
        cache = PrefixCache(cache_bytes, fingerprint=model_fingerprint(model), cache_dir=cache_dir,
                            max_disk_bytes=cache_disk_bytes)
    engine = Engine(model, max_context=max_context, cache=cache)
    app = create_app(engine, model_id=model_id, api_key=api_key)
    sock = listen(host, port)
    bound = sock.getsockname()[1]
    if api_key is None and not _is_loopback(host):
        print(f"lily: warning: serving on {host} without --api-key: anyone who can reach it can use it",
              file=sys.stderr)
    print(f"lily: serving {model_id} at http://{host}:{bound}/v1 (context {engine.max_context} tokens)",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


def _is_loopback(host: str) -> bool:
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1"
                   for info in socket.getaddrinfo(host, None))
    except OSError:
        return False
