"""The OpenAI API: POST /v1/chat/completions and /v1/completions, as JSON or server-sent events: their request
bodies checked and turned into prompts for the engine, and the engine's tokens turned into their responses."""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.routing import Route

from lily.generate import GenerationResponse
from lily.model import Model
from lily.parsers import Delta, OutputParser
from lily.sampling import MAX_TOP_LOGPROBS
from lily.server.engine import Engine, Job, Prompt, Usage
from lily.server.protocol import (RequestError, Sampling, field, json_arguments, json_type, parse_sampling,
                                  render_conversation, sse, stream_options, text_content)

_RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")


# -- requests ------------------------------------------------------------------------------------------------

def _history_tool_call(call, where: str) -> dict:
    """An assistant message's OpenAI tool call, with its JSON `arguments` read into a dict for the template."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise RequestError(f"'{where}' must be an object with function.name", param=where)
    args = json_arguments(fn.get("arguments", "{}"), where + ".function.arguments")
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
            raise RequestError(f"'{where}' must be an object, got {json_type(m)}", param=where)
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"'{where}.role' must be system, developer, user, assistant or tool, got {role!r}",
                               param=where + ".role")
        if m.get("content") is None and not (role == "assistant" and m.get("tool_calls") is not None):
            raise RequestError(f"'{where}.content' is missing: only an assistant message with tool_calls may leave it "
                               "out", param=where + ".content")  # as OpenAI's API, and lily.chat.check_messages
        content = text_content(m.get("content"), where + ".content")
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
            calls = field(m, "tool_calls", (list,), where + ".")
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
    tools = field(body, "tools", (list,))
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" or \
                not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": …}}}}",
                               param=f"tools[{i}]")
        field(fn, "description", (str,), f"tools[{i}].function.")
        field(fn, "parameters", (dict,), f"tools[{i}].function.")  # a JSON schema
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
    kwargs = dict(field(body, "chat_template_kwargs", (dict,)) or {})
    for name in _RESERVED_TEMPLATE_KWARGS:
        if name in kwargs:
            raise RequestError(f"'chat_template_kwargs' may not set {name!r}", param="chat_template_kwargs")
    thinking = field(body, "enable_thinking", (bool,))
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    if not isinstance(kwargs.get("enable_thinking", True), bool):
        raise RequestError("'chat_template_kwargs.enable_thinking' must be a boolean",
                           param="chat_template_kwargs.enable_thinking")
    logprobs = bool(field(body, "logprobs", (bool,)))
    top = field(body, "top_logprobs", (int,))
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'top_logprobs' must be in 0..{MAX_TOP_LOGPROBS}, got {top}", param="top_logprobs")
    if top and not logprobs:
        raise RequestError("'logprobs' must be true when 'top_logprobs' is set", param="top_logprobs")
    sampling = parse_sampling(body, model, ("max_completion_tokens", "max_tokens"), top or 0)
    stream, include_usage = stream_options(body)
    return ChatRequest(messages, tools, kwargs, sampling, stream, include_usage, logprobs)


def render_chat(model: Model, req: ChatRequest) -> str:
    """The prompt text of a chat request (the model's chat template with the generation prompt)."""
    return render_conversation(model, req.messages, req.tools, req.template_kwargs)


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
    if field(body, "suffix", (str,)):
        raise RequestError("'suffix' is not supported", param="suffix")
    logprobs = field(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"'logprobs' must be in 0..{MAX_TOP_LOGPROBS}, got {logprobs}", param="logprobs")
    sampling = parse_sampling(body, model, ("max_tokens",), logprobs or 0)
    stream, include_usage = stream_options(body)
    return CompletionRequest(prompt, sampling, stream, include_usage, logprobs, bool(field(body, "echo", (bool,))))



# -- responses -----------------------------------------------------------------------------------------------

class OpenAI:
    """The handlers of the OpenAI routes, over the server's shared request plumbing (`srv`: app.Server)."""

    def __init__(self, srv):
        self.srv = srv

    def routes(self) -> list[Route]:
        srv = self.srv
        return [Route("/v1/chat/completions", srv.endpoint("/v1/chat/completions", self.chat), methods=["POST"]),
                Route("/v1/completions", srv.endpoint("/v1/completions", self.completions), methods=["POST"])]

    async def chat(self, request):
        req = parse_chat_request(await self.srv.body(request), self.srv.engine.model)
        job, watcher, parser = await self.srv.start_chat(request, req.messages, req.tools, req.template_kwargs,
                                                         req.sampling)
        rid, created = "chatcmpl-" + uuid.uuid4().hex, int(time.time())
        if req.stream:
            return self.srv.stream(self._chat_chunks(req, job, parser, rid, created), job, watcher)
        try:
            out, logprobs = Delta(), []
            while True:
                kind, value = await job.next()
                if kind == "token":
                    out += parser.feed(value.text)
                    logprobs += self._chat_logprobs(value) if req.logprobs else []
                elif kind == "done":
                    out += parser.finish()
                    self.srv.finish_chat(job, out)
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
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": self.srv.model_id,
                             "choices": [choice], "usage": value.to_openai()})

    async def _chat_chunks(self, req: ChatRequest, job: Job, parser: OutputParser, rid: str, created: int):
        def chunk(delta: dict, finish: str | None = None, logprobs=None) -> str:
            c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.srv.model_id,
                 "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
            if req.include_usage:
                c["usage"] = None
            return sse(c)

        yield chunk({"role": "assistant", "content": ""})
        out = Delta()  # the reply so far
        while True:
            kind, value = await job.next()
            if kind == "error":
                yield sse(value.body())
                return
            d = parser.feed(value.text) if kind == "token" else parser.finish()
            delta = {}
            if d.reasoning:
                delta["reasoning_content"] = d.reasoning
            if d.content:
                delta["content"] = d.content
            if d.tool_calls:
                delta["tool_calls"] = [c.to_openai(len(out.tool_calls) + i) for i, c in enumerate(d.tool_calls)]
            out += d
            if kind == "done":
                self.srv.finish_chat(job, out)
            logprobs = None
            if kind == "token" and req.logprobs and (entries := self._chat_logprobs(value)):
                logprobs = {"content": entries}
            if delta or logprobs:
                yield chunk(delta, logprobs=logprobs)
            if kind == "done":
                yield chunk({}, _finish(value, out))
                if req.include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": self.srv.model_id, "choices": [], "usage": value.to_openai()})
                yield "data: [DONE]\n\n"
                return

    def _chat_logprobs(self, r: GenerationResponse) -> list[dict]:
        if not self._reported(r):
            return []

        def entry(token: int, logprob: float) -> dict:
            engine = self.srv.engine
            return {"token": engine.token_text(token), "logprob": logprob, "bytes": list(engine.token_bytes(token))}

        return [{**entry(r.token, r.logprob), "top_logprobs": [entry(t, lp) for t, lp in r.top_logprobs]}]

    def _reported(self, r: GenerationResponse) -> bool:
        """Whether a generated token is part of the answer (an end-of-sequence token is not)."""
        return r.token >= 0 and not (r.finish_reason == "stop" and r.token in self.srv.engine.model.eos_token_ids)

    async def completions(self, request):
        model = self.srv.engine.model
        req = parse_completion_request(await self.srv.body(request), model)
        if isinstance(req.prompt, str):  # tokenised off the event loop and the worker
            ids = await asyncio.to_thread(self.srv.engine.tokenize, req.prompt, "prompt")
            job = Job(lambda m: Prompt(ids, req.prompt), req.sampling, "prompt")
        else:
            job = Job(lambda m: Prompt(list(req.prompt), m.tokenizer.decode(req.prompt)), req.sampling, "prompt")
        prompt, watcher = await self.srv.start(request, job)
        rid, created = "cmpl-" + uuid.uuid4().hex, int(time.time())
        echo = prompt.text if req.echo else ""
        if req.stream:
            return self.srv.stream(self._completion_chunks(req, job, echo, rid, created), job, watcher)
        try:
            text, lp = [echo], _CompletionLogprobs(len(echo)) if req.logprobs is not None else None
            while True:
                kind, value = await job.next()
                if kind == "token":
                    text.append(value.text)
                    if lp is not None and self._reported(value):
                        lp.add(self.srv.engine, value)
                elif kind == "done":
                    break
                else:
                    raise value
        finally:
            watcher.cancel()
            job.cancel()
        choice = {"index": 0, "text": "".join(text), "logprobs": lp.to_openai() if lp else None,
                  "finish_reason": value.finish_reason}
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": self.srv.model_id,
                             "choices": [choice], "usage": value.to_openai()})

    async def _completion_chunks(self, req: CompletionRequest, job: Job, echo: str, rid: str, created: int):
        def chunk(text: str, finish: str | None = None, logprobs=None) -> str:
            c = {"id": rid, "object": "text_completion", "created": created, "model": self.srv.model_id,
                 "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
            if req.include_usage:
                c["usage"] = None
            return sse(c)

        if echo:
            yield chunk(echo)
        offset = len(echo)
        while True:
            kind, value = await job.next()
            if kind == "error":
                yield sse(value.body())
                return
            if kind == "done":
                yield chunk("", value.finish_reason)
                if req.include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.srv.model_id,
                                "choices": [], "usage": value.to_openai()})
                yield "data: [DONE]\n\n"
                return
            lp = None
            if req.logprobs is not None and self._reported(value):
                lp = _CompletionLogprobs(offset)
                lp.add(self.srv.engine, value)
            offset += len(value.text)
            if value.text or lp:
                yield chunk(value.text, logprobs=lp.to_openai() if lp else None)


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
