"""What every API of the server shares in reading a request and writing a response: the error it answers with, the
body read as bounded JSON, typed fields, sampling settings, text content, server-sent events. Each API's own
request and response shapes are in its module (openai.py, ...); nothing here touches the model's state."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np

from lily.model import Model
from lily.parsers import MAX_JSON_DEPTH
from lily.sampling import INT32_MAX, MAX_BIAS, MAX_BIAS_ENTRIES, SamplingParams

NUMBER = (int, float)
_KIND_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
               dict: "an object"}
_SAMPLING_FIELDS = (("temperature", NUMBER), ("top_p", NUMBER), ("top_k", (int,)), ("min_p", NUMBER),
                    ("presence_penalty", NUMBER), ("frequency_penalty", NUMBER),
                    ("repetition_penalty", NUMBER), ("seed", (int,)))


# -- errors ------------------------------------------------------------------------------------------------

class RequestError(Exception):
    """A request the server refuses: its HTTP status, message, the field at fault (`param`), an error code and
    type; each API writes it in its own error shape (`body()` is OpenAI's)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = message, status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def json_type(value) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}.get(
        type(value), type(value).__name__)


def field(body: dict, name: str, kinds: tuple, where: str = ""):
    """body[name] if present and not null (None otherwise), checked against JSON types (a boolean is no number)."""
    value = body.get(name)
    if value is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        wanted = "a number" if kinds == NUMBER else " or ".join(_KIND_NAMES[k] for k in kinds)
        raise RequestError(f"'{where}{name}' must be {wanted}, got {json_type(value)}", param=where + name)
    return value


# -- request bodies ------------------------------------------------------------------------------------------

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff written as a JSON escape
_SURROGATE = re.compile("[\ud800-\udfff]")


def reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_body(data: bytes) -> dict:
    """A request body read as a JSON object; RequestError (400) for anything else, including JSON nested more than
    MAX_JSON_DEPTH levels deep, NaN or Infinity, and strings with a lone UTF-16 surrogate (not Unicode text)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8: {e}") from e
    try:
        body = json.loads(text, parse_constant=reject_constant)
    except RecursionError:
        name = _too_deep_field(text)
        where = f"'{name}'" if name is not None else "the request body"
        raise RequestError(f"{where} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                           param=name) from None
    except ValueError as e:
        reason = "a number has more digits than this server reads (4300)" if "integer string" in str(e) else e
        raise RequestError(f"the request body is not valid JSON: {reason}") from e
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {json_type(body)}")
    # Walking the body is linear in its size; these byte scans (C speed) say when it is needed.
    if _nested_too_deep(data) or _SURROGATE_ESCAPE.search(data):
        check_json_value(body, "")
    return body


def _too_deep_field(text: str) -> str | None:
    """The top-level field of a JSON object whose value is nested too deeply for json to read (RecursionError),
    found by reading the object one field at a time; None if `text` is no object or no one field is."""
    decoder, ws = json.JSONDecoder(), re.compile(r"[ \t\n\r]*")
    i = ws.match(text).end()
    if not text.startswith("{", i):
        return None
    i += 1
    try:
        while True:
            i = ws.match(text, i).end()
            key, i = decoder.raw_decode(text, i)
            i = ws.match(text, i).end()
            if not text.startswith(":", i):
                return None
            try:
                _, i = decoder.raw_decode(text, ws.match(text, i + 1).end())
            except RecursionError:
                return printable(key) if isinstance(key, str) else None
            i = ws.match(text, i).end()
            if not text.startswith(",", i):
                return None
            i += 1
    except (ValueError, IndexError):
        return None


def _nested_too_deep(data: bytes) -> bool:
    """Whether valid JSON `data` nests arrays and objects more than MAX_JSON_DEPTH levels deep."""
    if data.count(b"[") + data.count(b"{") <= MAX_JSON_DEPTH:
        return False
    brackets = np.frombuffer(_JSON_STRING.sub(b"", data).translate(None, _NOT_BRACKETS), np.uint8)
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), np.int32(1), np.int32(-1))
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0)) > MAX_JSON_DEPTH


def printable(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def check_json_value(value, where: str) -> None:
    """Refuses a parsed JSON value (a request body, or tool-call arguments read from a string) that nests more than
    MAX_JSON_DEPTH levels deep or holds a string or key with a lone UTF-16 surrogate, naming where."""
    stack = [(value, 1, where)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, str):
            if (bad := _SURROGATE.search(item)) is not None:
                raise RequestError(f"'{path}' holds a lone UTF-16 surrogate ({printable(bad.group())}), which is "
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
            name = f"{path}.{printable(k)}" if path else printable(k)
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


def parse_sampling(body: dict, model: Model, max_token_names: tuple[str, ...], top_logprobs: int) -> Sampling:
    params = {}
    for name, kinds in _SAMPLING_FIELDS:
        value = field(body, name, kinds)
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
        value = field(body, name, (int,))
        if value is not None:
            if not 1 <= value <= INT32_MAX:
                raise RequestError(f"'{name}' must be in [1, {INT32_MAX}], got {value}", param=name)
            max_tokens = value
            break
    for name, kinds in (("n", (int,)), ("best_of", (int,))):
        value = field(body, name, kinds)
        if value is not None and value != 1:
            raise RequestError(f"'{name}' must be 1: this server returns one choice per request", param=name)
    bias = field(body, "logit_bias", (dict,))
    if bias:
        params["logit_bias"] = logit_bias(bias, model)
    # vLLM's, which benchmarks send for replies of a fixed length
    if field(body, "ignore_eos", (bool,)):  # the reply runs to max_tokens or a stop string
        params["ignore_eos"] = True
    min_tokens = field(body, "min_tokens", (int,))
    if min_tokens is not None:  # no end-of-sequence token among the first min_tokens
        params["min_tokens"] = min_tokens
    response_format = field(body, "response_format", (dict,))
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


def logit_bias(bias: dict, model: Model) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys: decimal strings) to biases in [-100, 100]."""
    if len(bias) > MAX_BIAS_ENTRIES:
        raise RequestError(f"'logit_bias' has {len(bias)} entries; at most {MAX_BIAS_ENTRIES}", param="logit_bias")
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10) or \
                int(key) >= model.n_valid:
            raise RequestError(f"'logit_bias' key {str(key)[:40]!r} is not a token id of this model (0 to "
                               f"{model.n_valid - 1})", param="logit_bias")
        number = isinstance(value, NUMBER) and not isinstance(value, bool)
        if not (number and -MAX_BIAS <= value <= MAX_BIAS):
            raise RequestError(f"'logit_bias[\"{key}\"]' must be a number in [-{MAX_BIAS}, {MAX_BIAS}], got "
                               f"{value if number else json_type(value)}", param="logit_bias")
        out[int(key)] = float(value)
    return out


def stream_options(body: dict) -> tuple[bool, bool]:
    stream = bool(field(body, "stream", (bool,)))
    options = field(body, "stream_options", (dict,)) or {}
    include_usage = bool(field(options, "include_usage", (bool,), "stream_options."))
    return stream, include_usage


def json_arguments(args, param: str) -> dict:
    """Tool-call arguments as the chat template takes them: a JSON object, sent as a string of JSON (OpenAI's
    way; empty means {}) or as an object; RequestError naming `param` for anything else."""
    if isinstance(args, str):
        try:
            args = json.loads(args, parse_constant=reject_constant) if args.strip() else {}
        except RecursionError:
            raise RequestError(f"'{param}' nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                               param=param) from None
        except ValueError as e:
            raise RequestError(f"'{param}' is not valid JSON: {e}", param=param) from e
        check_json_value(args, param)
    if not isinstance(args, dict):
        raise RequestError(f"'{param}' must be a JSON object", param=param)
    return args


def text_content(content, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise RequestError(f"'{where}[{j}].text' must be a string, got {json_type(part.get('text'))}",
                                   param=where)
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else json_type(part)
                raise RequestError(f"'{where}[{j}]': content parts of type {kind!r} are not supported (text only)",
                                   param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"'{where}' must be a string or an array of text parts, got {json_type(content)}",
                       param=where)


def sse(obj, event: str | None = None) -> str:
    """One server-sent event carrying `obj` as JSON (with an `event:` line when named)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def render_conversation(model: Model, messages: list[dict], tools: list[dict] | None, template_kwargs: dict,
                        param: str = "messages") -> str:
    """The prompt text of a conversation in the chat template's terms (role/content messages, assistant
    tool_calls with dict arguments, reasoning_content; OpenAI-style function tools), with the generation prompt.
    Every API turns its own request into these terms and renders it here."""
    try:
        return model.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                   **template_kwargs)
    except (ValueError, TypeError) as e:
        raise RequestError(f"the conversation cannot be rendered with the model's chat template: {e}",
                           param=param) from e
