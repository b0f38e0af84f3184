"""The Anthropic Messages API, as Claude Code and the `anthropic` client speak it: POST /v1/messages (JSON or
server-sent events) and POST /v1/messages/count_tokens. Request bodies are checked, naming the field as Anthropic
does (`messages.1.content.0.type`), and turned into the chat template's terms as openai.normalize_messages gives
them; the parser's deltas become Anthropic's content blocks (thinking, text, tool_use) and stream events; every
refusal is in Anthropic's error shape.

Where Lily differs from Anthropic's API (docs/serving.md says the same to users): `thinking` omitted leaves the
model's default (Qwen3.6 reasons), so that a conversation renders alike through every API; `budget_tokens` is read
but not enforced; thinking blocks come back with an empty `signature`; `input_tokens` counts the prompt tokens
prefilled, `cache_read_input_tokens` those restored from saved state (their sum is the prompt, as Anthropic
counts it); the billing line Claude Code puts at the start of its system prompt, different in every request, is
dropped so that the conversation's prefix stays the same."""
from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.routing import Route

from lily.generate import GenerationResponse
from lily.model import Model
from lily.parsers import Delta, OutputParser
from lily.sampling import MAX_STOPS
from lily.server.engine import Job, Usage
from lily.server.protocol import RequestError, Sampling, field, json_type, parse_sampling, render_conversation, sse

# Anthropic's error types for the statuses this server answers with; other 4xx are invalid requests, 5xx API errors.
_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large"}
# Claude Code's first system line: a hash of the request, so different every time (it would defeat prefix reuse).
_BILLING_LINE = re.compile(r"\Ax-anthropic-billing-header:[^\n]*\n?")
_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]  # of the route for any other path or method
_THINKING = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}


def error_body(e: RequestError) -> dict:
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def anthropic_error(e: RequestError) -> JSONResponse:
    return JSONResponse(error_body(e), status_code=e.status)


# -- requests ------------------------------------------------------------------------------------------------

def _shown(value) -> str:
    """A value in an error message: a string quoted, anything else by its JSON type."""
    return repr(value) if isinstance(value, str) else json_type(value)


def _kind(block, where: str, allowed: tuple[str, ...]) -> str:
    """The type of content block `block`, which must be one of `allowed`."""
    if not isinstance(block, dict):
        raise RequestError(f"'{where}' must be a content block (an object), got {json_type(block)}", param=where)
    kind = block.get("type")
    if kind not in allowed:
        why = "this model reads text only" if kind in ("image", "document") else f"expected {', '.join(allowed)}"
        raise RequestError(f"'{where}.type': {_shown(kind)} blocks are not supported here ({why})",
                           param=where + ".type")
    return kind


def _string(block: dict, name: str, where: str, non_empty: bool = False) -> str:
    value = block.get(name)
    if not isinstance(value, str) or (non_empty and not value):
        wanted = "a non-empty string" if non_empty else "a string"
        raise RequestError(f"'{where}.{name}' must be {wanted}, got {_shown(value)}", param=f"{where}.{name}")
    return value


def _text_blocks(content, where: str) -> list[str]:
    """The texts of `content`: a string, or an array of text blocks."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or an array of text blocks, got {json_type(content)}",
                           param=where)
    return [_string(b, "text", f"{where}.{j}") for j, b in enumerate(content) if _kind(b, f"{where}.{j}", ("text",))]


def _system(system) -> str:
    """The system prompt: a string or text blocks (joined by blank lines), without Claude Code's billing line."""
    texts = _text_blocks(system, "system")
    return "\n\n".join(t for t in (_BILLING_LINE.sub("", text) for text in texts) if t)


def _tool_result(block: dict, where: str) -> dict:
    call_id = _string(block, "tool_use_id", where)
    field(block, "is_error", (bool,), where + ".")  # the template has no place for it: the result's text says
    content = block.get("content")
    text = "" if content is None else "".join(_text_blocks(content, where + ".content"))
    return {"role": "tool", "content": text, "tool_call_id": call_id}


def _user_turns(content, where: str) -> list[dict]:
    """A user message: its text as a user turn, each tool_result as a tool message, in their order."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out, text = [], []  # text: the text blocks since the last tool_result
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        if _kind(block, at, ("text", "tool_result")) == "text":
            text.append(_string(block, "text", at))
            continue
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text = []
        out.append(_tool_result(block, at))
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant_turn(content, where: str) -> dict:
    """An assistant message: its text, its thinking as reasoning_content, its tool_use blocks as tool calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    text, reasoning, calls = [], [], []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = _kind(block, at, ("text", "thinking", "redacted_thinking", "tool_use"))
        if kind == "text":
            text.append(_string(block, "text", at))
        elif kind == "thinking":
            reasoning.append(_string(block, "thinking", at))
        elif kind == "tool_use":
            args = block.get("input")
            if not isinstance(args, dict):
                raise RequestError(f"'{at}.input' must be an object, got {json_type(args)}", param=at + ".input")
            calls.append({"type": "function", "function": {"name": _string(block, "name", at, non_empty=True),
                                                           "arguments": args}, "id": _string(block, "id", at)})
        # redacted_thinking: another model's encrypted reasoning, which nothing here can read: left out
    msg = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        msg["reasoning_content"] = "".join(reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def normalize_messages(body: dict) -> list[dict]:
    """A request's `system` and `messages` as the chat template expects them (openai.normalize_messages' terms)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty array", param="messages")
    system = _system(body["system"]) if body.get("system") is not None else ""
    out = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict):
            raise RequestError(f"'{where}' must be an object, got {json_type(m)}", param=where)
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise RequestError(f"'{where}.role' must be user or assistant, got {_shown(role)}", param=where + ".role")
        if not isinstance(content, (str, list)):
            raise RequestError(f"'{where}.content' must be a string or an array of content blocks, got "
                               f"{json_type(content)}", param=where + ".content")
        out += _user_turns(content, where + ".content") if role == "user" else [
            _assistant_turn(content, where + ".content")]
    if messages[-1]["role"] == "assistant":
        last = f"messages.{len(messages) - 1}"
        raise RequestError(f"'{last}': the last message must be the user's: Lily does not continue a prefilled "
                           "assistant turn", param=last + ".role")
    return out


def _tools(body: dict) -> list[dict] | None:
    """The request's custom tools as the chat template takes them (OpenAI function tools), or None when there are
    none or tool_choice is 'none'."""
    tools = field(body, "tools", (list,)) or []
    out = []
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict):
            raise RequestError(f"'{where}' must be an object, got {json_type(tool)}", param=where)
        if tool.get("type") not in ("custom", None):
            raise RequestError(f"'{where}.type': server tools ({_shown(tool['type'])}) are not supported: Lily "
                               "runs custom tools only (name, description, input_schema)", param=where + ".type")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise RequestError(f"'{where}.input_schema' must be an object (a JSON schema), got {json_type(schema)}",
                               param=where + ".input_schema")
        fn = {"name": _string(tool, "name", where, non_empty=True)}
        if tool.get("description") is not None:
            fn["description"] = _string(tool, "description", where)
        out.append({"type": "function", "function": {**fn, "parameters": schema}})
    choice = field(body, "tool_choice", (dict,)) or {"type": "auto"}
    if choice.get("type") not in ("auto", "none"):
        raise RequestError(f"tool_choice {_shown(choice.get('type'))} is not supported: only 'auto' and 'none' (Lily "
                           "does not constrain decoding, so it cannot force a tool call)", param="tool_choice.type")
    return None if choice["type"] == "none" else (out or None)


def _template_kwargs(body: dict) -> dict:
    thinking = field(body, "thinking", (dict,))
    if thinking is None:
        return {}  # the model's default
    if thinking.get("type") not in tuple(_THINKING):
        raise RequestError(f"'thinking.type' must be one of {', '.join(_THINKING)}, got {_shown(thinking.get('type'))}",
                           param="thinking.type")
    if thinking["type"] == "enabled" and field(thinking, "budget_tokens", (int,), "thinking.") is None:
        raise RequestError("'thinking.budget_tokens' is required when thinking is enabled",
                           param="thinking.budget_tokens")
    return {"enable_thinking": _THINKING[thinking["type"]]}


def parse_conversation(body: dict) -> tuple[list[dict], list[dict] | None, dict]:
    """(messages, tools, template kwargs) of a request, in the chat template's terms: what count_tokens reads."""
    return normalize_messages(body), _tools(body), _template_kwargs(body)


@dataclass
class MessagesRequest:
    messages: list[dict]
    tools: list[dict] | None
    template_kwargs: dict
    sampling: Sampling
    stream: bool


def parse_messages_request(body: dict, model: Model) -> MessagesRequest:
    """Checks a /v1/messages body; raises RequestError (a 400 naming the field) for anything wrong. Fields this
    server has no use for (metadata, service_tier, cache_control, ...) are ignored, as Anthropic's API does."""
    messages, tools, kwargs = parse_conversation(body)
    if body.get("max_tokens") is None:
        raise RequestError("'max_tokens' is required", param="max_tokens")
    stops = field(body, "stop_sequences", (list,)) or []
    if len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"'stop_sequences' must be an array of at most {MAX_STOPS} non-empty strings",
                           param="stop_sequences")
    config = field(body, "output_config", (dict,)) or {}
    for name, value in (("output_format", body.get("output_format")), ("output_config.format", config.get("format"))):
        if value is not None:
            raise RequestError(f"'{name}' is not supported: Lily does not constrain decoding", param=name)
    if field(body, "mcp_servers", (list,)):
        raise RequestError("'mcp_servers' is not supported: Lily runs no tools itself", param="mcp_servers")
    settings = {name: body[name] for name in ("temperature", "top_p", "top_k", "max_tokens") if name in body}
    sampling = parse_sampling({**settings, "stop": stops or None}, model, ("max_tokens",), 0)
    return MessagesRequest(messages, tools, kwargs, sampling, bool(field(body, "stream", (bool,))))


# -- responses -----------------------------------------------------------------------------------------------

def _event(obj: dict) -> str:
    return sse(obj, event=obj["type"])


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": u.cached_tokens}


class _Reply:
    """A reply as it is generated: the parser's deltas gathered (`out`, tool calls with Anthropic's ids) and laid
    out as content blocks in their order, a new block whenever the kind of text changes and one per tool call;
    each step returns the stream events it makes. The streamed and the whole reply are built by the same steps."""

    def __init__(self, parser: OutputParser, model: Model, stops: list[str]):
        self.parser, self.model, self.stops = parser, model, stops
        self.out, self.content = Delta(), []
        self.open: str | None = None  # the type of the last block while it is open (takes more text)
        self.ids: list[int] = []      # the tokens generated, to find the stop sequence that matched
        self.text_len = 0             # the characters of text the engine gave (a matched stop sequence is not)
        self.prompt_tokens = 0

    def token(self, r: GenerationResponse) -> list[str]:
        self.prompt_tokens = r.prompt_tokens
        self.text_len += len(r.text)
        if r.token >= 0:
            self.ids.append(r.token)
        return self._add(self.parser.feed(r.text))

    def finish(self) -> list[str]:
        return self._add(self.parser.finish()) + self._close()

    def _add(self, d: Delta) -> list[str]:
        events = []
        for kind, text in (("thinking", d.reasoning), ("text", d.content)):
            if not text:
                continue
            if self.open != kind:
                events += self._close()
                events += self._start({"type": kind, kind: "", **({"signature": ""} if kind == "thinking" else {})})
            self.content[-1][kind] += text
            events.append(_event({"type": "content_block_delta", "index": len(self.content) - 1,
                                  "delta": {"type": kind + "_delta", kind: text}}))
        for call in d.tool_calls:
            call.id = "toolu_" + uuid.uuid4().hex[:24]
            events += self._close()
            events += self._start({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            self.content[-1]["input"] = json.loads(call.arguments)
            events.append(_event({"type": "content_block_delta", "index": len(self.content) - 1,
                                  "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))
            events += self._close()
        self.out += d
        return events

    def _start(self, block: dict) -> list[str]:
        self.content.append(block)
        self.open = block["type"]
        return [_event({"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        index, events = len(self.content) - 1, []
        if self.open == "thinking":
            events.append(_event({"type": "content_block_delta", "index": index,
                                  "delta": {"type": "signature_delta", "signature": ""}}))
        self.open = None
        return events + [_event({"type": "content_block_stop", "index": index})]

    def stop(self, usage: Usage, max_tokens: int) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished reply."""
        if usage.finish_reason == "length":
            return "max_tokens" if usage.completion_tokens >= max_tokens else "model_context_window_exceeded", None
        if self.out.tool_calls:
            return "tool_use", None
        if not self.stops or (self.ids and self.ids[-1] in self.model.eos_token_ids):
            return "end_turn", None
        # A stop sequence ended the reply: the engine's text ends where it begins. Decoded as the engine decodes.
        detok = self.model.tokenizer.detokenizer()
        rest = "".join(detok.add(t) for t in self.ids)[self.text_len:]
        matched = [s for s in self.stops if rest.startswith(s)]
        return "stop_sequence", min(matched, key=len) if matched else None


class Anthropic:
    """The handlers of the Anthropic routes, over the server's shared request plumbing (`srv`: app.Server)."""

    def __init__(self, srv):
        self.srv = srv

    def routes(self) -> list[Route]:
        def endpoint(name, handler):
            return self.srv.endpoint(name, handler, error=anthropic_error)

        return [Route("/v1/messages", endpoint("/v1/messages", self.messages), methods=["POST"]),
                Route("/v1/messages/count_tokens", endpoint("/v1/messages/count_tokens", self.count_tokens),
                      methods=["POST"]),
                Route("/v1/messages{rest:path}", endpoint("other", self.no_route), methods=_METHODS)]

    async def no_route(self, request):
        if request.url.path in ("/v1/messages", "/v1/messages/count_tokens"):
            raise RequestError(f"{request.method} is not allowed here: use POST", status=405)
        raise RequestError(f"there is no route {request.url.path}", status=404)

    async def count_tokens(self, request):
        messages, tools, kwargs = parse_conversation(await self.srv.body(request))
        model = self.srv.engine.model
        text = await asyncio.to_thread(render_conversation, model, messages, tools, kwargs)
        return JSONResponse({"input_tokens": len(await asyncio.to_thread(model.tokenizer.encode, text))})

    async def messages(self, request):
        req = parse_messages_request(await self.srv.body(request), self.srv.engine.model)
        job, watcher, parser = await self.srv.start_chat(request, req.messages, req.tools, req.template_kwargs,
                                                         req.sampling)
        reply = _Reply(parser, self.srv.engine.model, req.sampling.params.get("stop") or [])
        mid = "msg_" + uuid.uuid4().hex[:24]
        if req.stream:
            return self.srv.stream(self._events(req, job, reply, mid), job, watcher)
        try:
            while True:
                kind, value = await job.next()
                if kind == "error":
                    raise value
                if kind == "token":
                    reply.token(value)
                    continue
                reply.finish()
                self.srv.finish_chat(job, reply.out)
                break
        finally:
            watcher.cancel()
            job.cancel()
        stop_reason, stop_sequence = reply.stop(value, req.sampling.max_tokens)
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": self.srv.model_id,
                             "content": reply.content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                             "usage": _usage(value)})

    async def _events(self, req: MessagesRequest, job: Job, reply: _Reply, mid: str):
        """The stream: message_start once the first token shows the prompt's size, the content blocks' events,
        message_delta with why it stopped and the usage, message_stop; an `error` event if the request fails."""
        started = False
        while True:
            kind, value = await job.next()
            if kind == "error":
                yield _event(error_body(value))
                return
            events = reply.token(value) if kind == "token" else reply.finish()
            if not started:
                started = True
                usage = {"input_tokens": reply.prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                         "cache_read_input_tokens": 0}
                yield _event({"type": "message_start", "message": {
                    "id": mid, "type": "message", "role": "assistant", "model": self.srv.model_id, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": usage}})
                yield _event({"type": "ping"})
            for e in events:
                yield e
            if kind == "done":
                self.srv.finish_chat(job, reply.out)
                stop_reason, stop_sequence = reply.stop(value, req.sampling.max_tokens)
                yield _event({"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                                 "stop_sequence": stop_sequence},
                              "usage": _usage(value)})
                yield _event({"type": "message_stop"})
                return
