"""The OpenAI Responses API: POST /v1/responses (JSON or server-sent events), GET and DELETE /v1/responses/{id}.
A request's `input` items (messages, function calls and their outputs, reasoning) and `instructions` are turned
into chat-template messages, as the chat completions API's are (openai.py); the model's reply comes back as output
items (reasoning, message, function_call). Stored responses (`store`, the default) are kept in memory, so that a
request naming one as `previous_response_id` continues its conversation: from the engine's saved state, with no
prefill of what the state already holds."""
from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from starlette.responses import JSONResponse
from starlette.routing import Route

from lily.model import Model
from lily.parsers import Delta, OutputParser, ToolCall
from lily.server.engine import Job, Usage
from lily.server.protocol import (RequestError, Sampling, field, json_arguments, json_type, parse_sampling, sse,
                                  text_content)

# Responses kept for GET and previous_response_id, the most recently created or continued first; older ones are
# forgotten. A stored conversation shares its messages with the one it continued, so each costs little more than
# its own turn.
MAX_STORED_RESPONSES = 4096

# reasoning.effort as the chat template's enable_thinking: Qwen3.6 either reasons or does not.
_THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True, "max": True}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


# -- requests ------------------------------------------------------------------------------------------------

def _text(content, where: str, part_types: tuple[str, ...]) -> str:
    """Text content: a string, or parts of `part_types` ({type, text}; a refusal part's text is its `refusal`)."""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else json_type(part)
            if kind not in part_types:
                raise RequestError(f"'{where}[{j}]': content parts of type {kind!r} are not supported (text only: "
                                   f"{', '.join(part_types)})", param=f"{where}[{j}]")
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise RequestError(f"'{where}[{j}].text' must be a string", param=f"{where}[{j}].text")
            parts.append(text)
        return "".join(parts)
    if content is None:
        raise RequestError(f"'{where}' is missing", param=where)
    return text_content(content, where)  # a string, or the error naming `where`


def _string(item: dict, name: str, where: str) -> str:
    value = field(item, name, (str,), where + ".")
    if not value:
        raise RequestError(f"'{where}.{name}' must be a non-empty string", param=f"{where}.{name}")
    return value


def _reasoning(item: dict, where: str) -> str | None:
    """A reasoning item's text: its reasoning_text content, else its summary (encrypted content is not read)."""
    for name, kind, joint in (("content", "reasoning_text", ""), ("summary", "summary_text", "\n\n")):
        parts = field(item, name, (list,), where + ".")
        if parts:
            _text(parts, f"{where}.{name}", (kind,))  # checks them
            return joint.join(p["text"] for p in parts) or None
    return None


def input_messages(value, history: list[dict]) -> list[dict]:
    """A request's `input` (a string, or a list of items) in chat-template terms, as openai.normalize_messages
    writes them, system messages left in place; `history` is the conversation it continues. Consecutive
    function_call items are one assistant message's tool_calls; a reasoning item is the reasoning_content of the
    assistant message or calls that follow it (dropped where none do)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("'input' must be a string or a non-empty array of items", param="input")
    out: list[dict] = []
    calls = {c.get("id") for m in history for c in m.get("tool_calls", ())}
    reasoning = None  # the text of a reasoning item, for the assistant turn that follows it
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{where}' must be an object, got {json_type(item)}", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            reasoning = _reasoning(item, where)
            continue
        if kind == "message":
            given = item.get("role")
            role = _ROLES.get(given) if isinstance(given, str) else None  # a list or an object is no key
            if role is None:
                raise RequestError(f"'{where}.role' must be user, assistant, system or developer, got "
                                   f"{given!r}", param=where + ".role")
            parts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            msg = {"role": role, "content": _text(item.get("content"), where + ".content", parts)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"] = reasoning
        elif kind == "function_call":
            call = {"type": "function", "function": {
                "name": _string(item, "name", where),
                "arguments": json_arguments(item.get("arguments", "{}"), where + ".arguments")},
                "id": _string(item, "call_id", where)}
            calls.add(call["id"])
            if reasoning is None and out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                continue
            msg = {"role": "assistant", "content": ""}
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            msg["tool_calls"] = [call]
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in calls:
                raise RequestError(f"'{where}.call_id': no function_call with call_id {call_id!r} comes before it",
                                   param=where + ".call_id")
            output = _text(item.get("output"), where + ".output", ("input_text", "output_text"))
            msg = {"role": "tool", "content": output, "tool_call_id": call_id}
        else:
            raise RequestError(f"'{where}.type': items of type {kind!r} are not supported (message, function_call, "
                               "function_call_output, reasoning)", param=where + ".type")
        reasoning = None
        out.append(msg)
    return out


def with_instructions(instructions: str | None, conversation: list[dict]) -> list[dict]:
    """The messages the template renders: the instructions and every system message merged into one at the start,
    as openai.normalize_messages merges a chat's."""
    system = ([] if instructions is None else [instructions]) + \
        [m["content"] for m in conversation if m["role"] == "system"]
    rest = [m for m in conversation if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def _tools(body: dict) -> tuple[list[dict], list[dict] | None]:
    """(the request's tools as sent, the same in the chat template's terms or None when none or tool_choice is
    'none')."""
    tools = field(body, "tools", (list,)) or []
    converted = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise RequestError(f"'{where}' must be an object, got {json_type(tool)}", param=where)
        if tool.get("type") != "function":
            raise RequestError(f"'{where}.type': tools of type {tool.get('type')!r} are not supported (function "
                               "tools only)", param=where + ".type")
        fn = {"name": _string(tool, "name", where)}
        for name, kinds in (("description", (str,)), ("parameters", (dict,))):
            value = field(tool, name, kinds, where + ".")
            if value is not None:
                fn[name] = value
        converted.append({"type": "function", "function": fn})
    choice = body.get("tool_choice", "auto")
    if choice not in ("auto", "none", None):
        raise RequestError(f"tool_choice {choice!r} is not supported: only 'auto' and 'none' (Lily does not "
                           "constrain decoding)", param="tool_choice")
    return tools, None if choice == "none" else (converted or None)


def _refuse_unsupported(body: dict) -> None:
    """Refuses the settings Lily cannot honour, when set to anything but their default."""
    if field(body, "background", (bool,)):
        raise RequestError("'background' is not supported: responses are generated while the request waits",
                           param="background")
    for name in ("conversation", "prompt", "context_management"):
        if body.get(name) is not None:
            raise RequestError(f"'{name}' is not supported", param=name)
    if field(body, "top_logprobs", (int,)) or "message.output_text.logprobs" in (field(body, "include", (list,))
                                                                               or ()):
        raise RequestError("logprobs are not supported by the Responses API here (use /v1/chat/completions)",
                           param="top_logprobs" if body.get("top_logprobs") else "include")
    if field(body, "truncation", (str,)) not in (None, "disabled"):
        raise RequestError("truncation must be 'disabled': Lily refuses a conversation longer than the context",
                           param="truncation")
    text = field(body, "text", (dict,)) or {}
    fmt = field(text, "format", (dict,), "text.") or {}
    if fmt.get("type", "text") != "text":
        raise RequestError(f"text.format {fmt.get('type')!r} is not supported (only 'text': Lily does not "
                           "constrain decoding)", param="text.format")


@dataclass
class ResponsesRequest:
    conversation: list[dict]  # the continued conversation and this input, system messages in place
    messages: list[dict]  # what the template renders: the conversation with the instructions
    tools: list[dict] | None  # in the chat template's terms
    template_kwargs: dict
    sampling: Sampling
    stream: bool
    store: bool
    one_call: bool  # parallel_tool_calls false: at most one function call per response
    echo: dict  # the settings the Response object repeats


def parse_responses_request(body: dict, model: Model, stored: StoredResponses) -> ResponsesRequest:
    """Checks a POST /v1/responses body; raises RequestError (an OpenAI-style 4xx naming the field) for anything
    wrong, or for a previous_response_id not in `stored`."""
    _refuse_unsupported(body)
    previous_id = field(body, "previous_response_id", (str,))
    history = []
    if previous_id is not None:
        entry = stored.get(previous_id)
        if entry is None:
            raise RequestError(f"Previous response with id '{previous_id}' not found.", status=404,
                               param="previous_response_id", code="previous_response_not_found")
        history = entry.conversation
    conversation = history + input_messages(body.get("input"), history)
    instructions = field(body, "instructions", (str,))
    sent_tools, tools = _tools(body)
    reasoning = field(body, "reasoning", (dict,)) or {}
    effort = field(reasoning, "effort", (str,), "reasoning.")
    if effort is not None and effort not in _THINKING:
        raise RequestError(f"'reasoning.effort' must be one of {', '.join(_THINKING)}, got {effort!r}",
                           param="reasoning.effort")
    metadata = field(body, "metadata", (dict,)) or {}
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise RequestError(f"'metadata.{key}' must be a string, got {json_type(value)}", param=f"metadata.{key}")
    sampling = parse_sampling(body, model, ("max_output_tokens",), 0)
    settings = sampling.build(model, 1)
    store = field(body, "store", (bool,))
    parallel = field(body, "parallel_tool_calls", (bool,))
    echo = {"instructions": instructions, "max_output_tokens": sampling.max_tokens, "metadata": metadata,
            "parallel_tool_calls": parallel is not False, "previous_response_id": previous_id,
            "reasoning": {"effort": effort, "summary": field(reasoning, "summary", (str,), "reasoning.")},
            "store": store is not False, "temperature": settings.temperature, "text": {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": sent_tools, "top_p": settings.top_p,
            "truncation": "disabled", "user": field(body, "user", (str,))}
    return ResponsesRequest(conversation, with_instructions(instructions, conversation), tools,
                            {} if effort is None else {"enable_thinking": _THINKING[effort]}, sampling,
                            bool(field(body, "stream", (bool,))), store is not False, parallel is False, echo)


def assistant_message(said: Delta) -> dict:
    """A reply as the assistant message of the conversation it continues (openai.normalize_messages' terms)."""
    msg = {"role": "assistant", "content": said.content}
    if said.reasoning:
        msg["reasoning_content"] = said.reasoning
    if said.tool_calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)},
                              "id": c.id} for c in said.tool_calls]
    return msg


@dataclass
class StoredResponse:
    response: dict  # the Response object
    conversation: list[dict]  # its conversation in chat-template terms, up to its reply (no instructions)


class StoredResponses:
    """The stored responses, by id: the MAX_STORED_RESPONSES most recently created or continued, in memory (a
    restart forgets them). Used on the event loop only."""

    def __init__(self, max_entries: int = MAX_STORED_RESPONSES):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, entry: StoredResponse) -> None:
        self._entries[rid] = entry
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def pop(self, rid: str) -> StoredResponse | None:
        return self._entries.pop(rid, None)


# -- responses -----------------------------------------------------------------------------------------------

def _part(kind: str) -> dict:
    return {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
        {"type": "output_text", "text": "", "annotations": []}


class Reply:
    """One response as it is generated: its output items, built from the parser's deltas, the stream events that
    announce them (dicts without sequence_number), and the Response object."""

    def __init__(self, req: ResponsesRequest, model_id: str):
        self.req, self.model_id = req, model_id
        self.id, self.created = "resp_" + uuid.uuid4().hex, int(time.time())
        self.status, self.usage, self.error, self.completed_at = "in_progress", None, None, None
        self.output: list[dict] = []
        self.said = Delta()  # what the model said, function calls past the first included
        self.reasoning_tokens = 0
        self._open: dict | None = None  # the reasoning or message item being written

    def add(self, d: Delta) -> list[dict]:
        self.said += d
        events = self._write("reasoning", d.reasoning) if d.reasoning else []
        if d.content:
            events += self._write("message", d.content)
        for call in d.tool_calls:
            if not (self.req.one_call and any(item["type"] == "function_call" for item in self.output)):
                events += self._call(call)
        return events

    def finish(self, usage: Usage) -> list[dict]:
        """The events closing the output (a message, empty, when the model said nothing at all)."""
        self.status = "incomplete" if usage.finish_reason == "length" else "completed"
        self.completed_at = int(time.time())
        self.usage = {"input_tokens": usage.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                      "output_tokens": usage.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                      "total_tokens": usage.prompt_tokens + usage.completion_tokens}
        return (self._write("message", "") if not self.output else []) + self._close()

    def fail(self, error: RequestError) -> dict:
        self.status, self.error = "failed", {"code": "server_error", "message": error.message}
        return {"type": "response.failed", "response": self.response()}

    def response(self) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
                "completed_at": self.completed_at, "background": False, "error": self.error,
                "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
                "model": self.model_id, "output": copy.deepcopy(self.output), "usage": self.usage, **self.req.echo}

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events = self._close()
            prefix = "rs_" if kind == "reasoning" else "msg_"
            self._open = {"id": prefix + uuid.uuid4().hex, "type": kind}
            self._open.update({"summary": []} if kind == "reasoning" else {"role": "assistant",
                                                                            "status": "in_progress"})
            self.output.append(self._open)
            events += [{"type": "response.output_item.added", "output_index": len(self.output) - 1,
                        "item": {**self._open, "content": []}},
                       {"type": "response.content_part.added", **self._at(), "part": _part(kind)}]
            self._open["content"] = [_part(kind)]
        if text:
            self._open["content"][0]["text"] += text
            events.append({"type": f"response.{self._text_event()}.delta", **self._at(), "delta": text,
                           **({"logprobs": []} if kind == "message" else {})})
        return events

    def _close(self) -> list[dict]:
        item = self._open
        if item is None:
            return []
        part = item["content"][0]
        events = [{"type": f"response.{self._text_event()}.done", **self._at(), "text": part["text"],
                   **({"logprobs": []} if item["type"] == "message" else {})},
                  {"type": "response.content_part.done", **self._at(), "part": dict(part)}]
        if item["type"] == "message":
            item["status"] = "incomplete" if self.status == "incomplete" else "completed"
        self._open = None
        return events + [{"type": "response.output_item.done", "output_index": len(self.output) - 1,
                          "item": copy.deepcopy(item)}]

    def _call(self, call: ToolCall) -> list[dict]:
        events = self._close()
        item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": "completed"}
        self.output.append(item)
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        return events + [
            {"type": "response.output_item.added", "output_index": at["output_index"],
             "item": {**item, "arguments": "", "status": "in_progress"}},
            {"type": "response.function_call_arguments.delta", **at, "delta": call.arguments},
            {"type": "response.function_call_arguments.done", **at, "arguments": call.arguments},
            {"type": "response.output_item.done", "output_index": at["output_index"], "item": dict(item)}]

    def _at(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1, "content_index": 0}

    def _text_event(self) -> str:
        return "reasoning_text" if self._open["type"] == "reasoning" else "output_text"

    def conversation(self) -> list[dict]:
        """The conversation up to this reply, as returned (the calls past the first dropped, for one_call)."""
        calls = {item["call_id"] for item in self.output if item["type"] == "function_call"}
        returned = Delta(self.said.reasoning, self.said.content, [c for c in self.said.tool_calls if c.id in calls])
        return self.req.conversation + [assistant_message(returned)]


class Responses:
    """The handlers of the Responses routes, over the server's shared request plumbing (`srv`: app.Server), and
    the stored responses."""

    def __init__(self, srv):
        self.srv = srv
        self.stored = StoredResponses()

    def routes(self) -> list[Route]:
        srv, one = self.srv, "/v1/responses/{response_id}"
        return [Route("/v1/responses", srv.endpoint("/v1/responses", self.create), methods=["POST"]),
                Route(one, srv.endpoint("/v1/responses/{id}", self.retrieve), methods=["GET"]),
                Route(one, srv.endpoint("/v1/responses/{id}", self.delete), methods=["DELETE"])]

    async def create(self, request):
        req = parse_responses_request(await self.srv.body(request), self.srv.engine.model, self.stored)
        job, watcher, parser = await self.srv.start_chat(request, req.messages, req.tools, req.template_kwargs,
                                                         req.sampling, param="input",
                                                         held_history=req.echo["previous_response_id"] is not None)
        reply = Reply(req, self.srv.model_id)
        if req.stream:
            return self.srv.stream(self._events(job, parser, reply), job, watcher)
        try:
            async for _ in self._run(job, parser, reply):
                pass
        finally:
            watcher.cancel()
            job.cancel()
        return JSONResponse(reply.response())

    async def _run(self, job: Job, parser: OutputParser, reply: Reply):
        """The reply's events as the engine's tokens come; at its end, the conversation recorded (and the response
        stored). Raises the engine's RequestError if it fails."""
        while True:
            kind, value = await job.next()
            if kind == "token":
                reply.reasoning_tokens += int(parser.in_reasoning)  # the tokens up to </think> included
                for event in reply.add(parser.feed(value.text)):
                    yield event
            elif kind == "done":
                for event in reply.add(parser.finish()) + reply.finish(value):
                    yield event
                self.srv.finish_chat(job, reply.said)
                if reply.req.store:
                    self.stored.put(reply.id, StoredResponse(reply.response(), reply.conversation()))
                yield {"type": f"response.{reply.status}", "response": reply.response()}
                return
            else:
                raise value

    async def _events(self, job: Job, parser: OutputParser, reply: Reply):
        numbers = itertools.count()

        def event(e: dict) -> str:
            return sse({"type": e["type"], "sequence_number": next(numbers), **e}, event=e["type"])

        yield event({"type": "response.created", "response": reply.response()})
        yield event({"type": "response.in_progress", "response": reply.response()})
        try:
            async for e in self._run(job, parser, reply):
                yield event(e)
        except RequestError as e:
            yield event(reply.fail(e))

    def _entry(self, request) -> tuple[str, StoredResponse]:
        rid = request.path_params["response_id"]
        entry = self.stored.get(rid)
        if entry is None:
            raise RequestError(f"Response with id '{rid}' not found.", status=404, param="response_id",
                               code="not_found")
        return rid, entry

    async def retrieve(self, request):
        return JSONResponse(self._entry(request)[1].response)

    async def delete(self, request):
        rid, _ = self._entry(request)
        self.stored.pop(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})
