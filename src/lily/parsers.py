"""Parsers of Qwen3.6 output: reasoning (`<think>…</think>`) and Qwen3-Coder XML tool calls, streaming.

The model's reply, after a prompt that opens a reasoning block (architecture.md §11.3), reads

    reasoning text\n</think>\n\n<answer text>\n\n
    <tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n</function>\n</tool_call>

`OutputParser` splits such text, fed in chunks of any size, into reasoning, content and tool calls. The
split does not depend on the chunking: feeding the text whole or a character at a time gives the same
concatenated reasoning, the same content and the same calls. Rules:

* The reply starts as reasoning when the prompt left a `<think>` open (`prompt_opens_thinking`); a
  `<think>` at the very start of the reply opens it too. `</think>` closes it.
* With tools, a `<tool_call>` block (or a bare `<function=…>…</function>`) is a call, in the content or
  inside the reasoning. Parameter values lose one leading and one trailing newline and are typed by the
  tool's JSON schema (string, integer, number, boolean, null, object, array; unions tried in order); a
  value that does not fit its type stays a string. The older JSON form `<tool_call>{"name": …,
  "arguments": {…}}</tool_call>` is read too.
* A block that is not a well-formed call, or a call cut off before `</function>`, is kept as text.
* Model output is untrusted: any text parses, without an exception. An object or array nested more than
  MAX_JSON_DEPTH levels deep, or an integer with more digits than Python converts (4,300), does not fit its
  type (a parameter stays a string; a JSON-form call stays text).
* Each channel drops its leading and trailing whitespace (the `\\n\\n` around `</think>` and between
  calls); whitespace inside is kept.
"""
from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, field

_NO_VALUE = object()  # "not a value of this type"

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"

_FUNCTION_TAG = re.compile(r"<function=([^\s<>]+)>")
_PARAMETER_TAG = re.compile(r"<parameter=([^\s<>]+)>")
_INTEGER = re.compile(r"[-+]?\d+")
# The deepest JSON a parsed call may hold, and a request may send (lily.server): deep enough for any real schema
# or argument, far from the recursion limits of json, the chat template and the clients.
MAX_JSON_DEPTH = 64


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's `function.arguments`
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class Delta:
    """What one chunk of model output adds to each channel."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __iadd__(self, other: Delta) -> Delta:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def prompt_opens_thinking(prompt_text: str) -> bool:
    """True if the last turn of a rendered prompt leaves a `<think>` block open (the model reasons first)."""
    turn = prompt_text[prompt_text.rfind("<|im_start|>"):]
    return turn.rfind(THINK_OPEN) > turn.rfind(THINK_CLOSE)


def nested_deeper_than(value, limit: int) -> bool:
    """Whether JSON-like `value` nests lists and dicts more than `limit` levels deep (a scalar: 0 levels)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return False


def _load_json(text: str):
    """json.loads, or _NO_VALUE for text that is not JSON, is nested more than MAX_JSON_DEPTH levels deep or
    holds an integer too long to convert."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return _NO_VALUE
    return _NO_VALUE if nested_deeper_than(value, MAX_JSON_DEPTH) else value


def _schema_types(schema, depth: int = 0) -> list[str]:
    """JSON-schema types a value may take, in the order to try them."""
    if not isinstance(schema, dict) or depth > MAX_JSON_DEPTH:
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for union in ("anyOf", "oneOf"):
        if isinstance(schema.get(union), list):
            return [k for sub in schema[union] for k in _schema_types(sub, depth + 1)]
    if isinstance(schema.get("enum"), list):
        names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
        return list(dict.fromkeys(names[type(v)] for v in schema["enum"] if type(v) in names))
    if "properties" in schema:
        return ["object"]
    if "items" in schema:
        return ["array"]
    return []


def _as_type(value: str, kind: str):
    """`value` read as JSON-schema type `kind`, or _NO_VALUE if it is not one."""
    text = value.strip()
    if kind == "null":
        return None if text == "null" else _NO_VALUE
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NO_VALUE)
    if kind in ("integer", "number"):
        if _INTEGER.fullmatch(text):
            try:
                return int(text)
            except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
                return _NO_VALUE
        try:
            number = float(text)
        except ValueError:
            return _NO_VALUE
        if not math.isfinite(number):
            return _NO_VALUE
        if kind == "integer":
            return int(number) if number.is_integer() else _NO_VALUE
        return number
    if kind in ("object", "array"):
        parsed = _load_json(text)
        return parsed if isinstance(parsed, dict if kind == "object" else list) else _NO_VALUE
    return _NO_VALUE


def convert_argument(value: str, schema: dict | None):
    """A parameter's text typed by its JSON schema; strings (and anything that fits no type) stay as written."""
    for kind in _schema_types(schema):
        if kind == "string":
            continue
        typed = _as_type(value, kind)
        if typed is not _NO_VALUE:
            return typed
    return value


def _parameter_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> its parameters' `properties` (OpenAI tool format, or bare function dicts)."""
    out = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            out[fn["name"]] = props if isinstance(props, dict) else {}
    return out


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _parse_json_call(body: str) -> ToolCall | None:
    """The older form: a JSON object with `name` and `arguments` (an object or a JSON string of one)."""
    obj = _load_json(body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _load_json(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _find(text: str, tag: str, start: int) -> int:
    """text.find(tag, start), or len(text) if it is not there."""
    at = text.find(tag, start)
    return len(text) if at < 0 else at


def parse_tool_call(body: str, schemas: dict[str, dict], closed: bool) -> ToolCall | None:
    """One call from the text inside `<tool_call>…</tool_call>` (or a bare `<function=…>` block), or None if
    the text is not a well-formed call. `closed`: the block ended with its closing tag; a block cut short
    counts only if its `</function>` is there."""
    body = body.strip()
    if body.startswith("{"):
        return _parse_json_call(body) if closed else None
    head = _FUNCTION_TAG.match(body)
    if head is None:
        return None
    name, rest = head.group(1), body[head.end():]
    end = rest.find(FUNCTION_CLOSE)
    if end >= 0:
        if rest[end + len(FUNCTION_CLOSE):].strip():
            return None  # text after </function> inside the call
        rest = rest[:end]
    elif not closed:
        return None  # cut off: the arguments may be incomplete
    props = schemas.get(name, {})
    args, pos, none = {}, 0, len(rest)
    # The next </parameter> and <parameter= at or after the value's start (`none`: there is none), each searched
    # again only once the values have passed it, so that many parameters cost one pass over the text.
    close = following = -1
    while True:
        while pos < len(rest) and rest[pos].isspace():
            pos += 1
        if pos == len(rest):
            break
        tag = _PARAMETER_TAG.match(rest, pos)
        if tag is None:
            return None  # stray text between parameters
        start = tag.end()
        if close < start:
            close = _find(rest, PARAMETER_CLOSE, start)
        if following < start:
            following = _find(rest, PARAMETER_OPEN, start)
        if following <= close:  # a missing </parameter> (or none at all): the value runs to the next tag
            stop = pos = following
        else:
            stop, pos = close, close + len(PARAMETER_CLOSE)
        args[tag.group(1)] = convert_argument(_strip_one_newline(rest[start:stop]), props.get(tag.group(1)))
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


class _Channel:
    """Text of one channel (reasoning or content) with its leading and trailing whitespace dropped: trailing
    whitespace is held back until more text shows it is inside."""

    def __init__(self):
        self.started = False
        self.pending = ""

    def write(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        body = text.rstrip()
        if not body:
            self.pending += text
            return ""
        out, self.pending = self.pending + body, text[len(body):]
        return out


class OutputParser:
    """Streaming split of model output into reasoning, content and tool calls (see the module docstring).

    `reasoning`: the prompt left a `<think>` block open. `tools`: the request's tools (OpenAI format); None
    turns tool-call parsing off, so tags stay text."""

    def __init__(self, *, reasoning: bool = False, tools: list[dict] | None = None):
        self.in_reasoning = reasoning
        self.parse_tools = tools is not None
        self._schemas = _parameter_schemas(tools)
        self._buf = ""            # text not yet decided
        self._call: str | None = None  # the opening tag of the call block being read
        self._call_parts: list[str] = []  # the call block's text after its opening tag, as it came
        self._call_tail = ""      # its last characters, where an end tag may have begun
        self._may_open_think = True  # nothing but whitespace has been seen yet
        self._channels = {True: _Channel(), False: _Channel()}

    def feed(self, text: str) -> Delta:
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> Delta:
        """The rest, at the end of the output; a call block left open is a call only if its function closed."""
        return self._drain(final=True)

    def _emit(self, out: Delta, text: str) -> None:
        if not text:
            return
        if text.strip():
            self._may_open_think = False
        written = self._channels[self.in_reasoning].write(text)
        if self.in_reasoning:
            out.reasoning += written
        else:
            out.content += written

    def _markers(self) -> list[str]:
        marks = [CALL_OPEN, FUNCTION_OPEN] if self.parse_tools else []
        if self.in_reasoning:
            marks.append(THINK_CLOSE)
        if self._may_open_think:
            marks.append(THINK_OPEN)
        return marks

    def _call_ends(self) -> list[tuple[str, bool]]:
        """(tag, inclusive) pairs that end the open call block; a new call or the end of the reasoning ends it
        without being part of it."""
        ends = [(CALL_CLOSE if self._call == CALL_OPEN else FUNCTION_CLOSE, True), (CALL_OPEN, False)]
        if self._call == FUNCTION_OPEN:
            ends.append((FUNCTION_OPEN, False))
        if self.in_reasoning:
            ends.append((THINK_CLOSE, False))
        return ends

    def _drain(self, final: bool) -> Delta:
        out = Delta()
        while True:
            if self._call is not None:
                if not self._drain_call(out, final):
                    break
                continue
            marks = self._markers()
            found = [(i, m) for m in marks if (i := self._buf.find(m)) >= 0]
            # <think> opens the reasoning only before any other text.
            found = [(i, m) for i, m in found if m != THINK_OPEN or not self._buf[:i].strip()]
            if not found:
                keep = 0 if final else _partial_suffix(self._buf, marks)
                self._emit(out, self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            at, mark = min(found)
            self._emit(out, self._buf[:at])
            self._buf = self._buf[at + len(mark):]
            if mark == THINK_CLOSE:
                self.in_reasoning = False
            elif mark == THINK_OPEN:
                self.in_reasoning = True
            else:
                self._call = mark
            self._may_open_think = False
        if final:
            for channel in self._channels.values():
                channel.pending = ""
        return out

    def _drain_call(self, out: Delta, final: bool) -> bool:
        """Moves text into the open call block and closes it when it ends; False when more text is needed.
        The block's text is kept in pieces and searched only where an end tag could still be (the new text and
        the tail before it), so that a long call costs time linear in its length."""
        ends = self._call_ends()
        window, self._buf = self._call_tail + self._buf, ""
        found = [(i, tag, inclusive) for tag, inclusive in ends if (i := window.find(tag)) >= 0]
        if found:
            at, tag, inclusive = min(found)
            before = "".join(self._call_parts)
            body = before[:len(before) - len(self._call_tail)] + window[:at]
            self._buf = window[at + (len(tag) if inclusive else 0):]
            self._close_call(out, body, tag if inclusive else "", closed=inclusive)
            return True
        self._call_parts.append(window[len(self._call_tail):])
        self._call_tail = window[max(0, len(window) - max(len(tag) for tag, _ in ends) + 1):]
        if final:
            self._close_call(out, "".join(self._call_parts), "", closed=False)
        return False

    def _close_call(self, out: Delta, body: str, end_tag: str, closed: bool) -> None:
        opener, self._call, self._call_parts, self._call_tail = self._call, None, [], ""
        text = body if opener == CALL_OPEN else opener + body + end_tag
        call = parse_tool_call(text, self._schemas, closed)
        if call is None:
            self._emit(out, opener + body + end_tag)
        else:
            out.tool_calls.append(call)


def _partial_suffix(text: str, marks: list[str]) -> int:
    """Length of the longest end of `text` that could be the start of one of `marks`."""
    longest = max((len(m) for m in marks), default=1) - 1
    for n in range(min(longest, len(text)), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in marks):
            return n
    return 0


@dataclass
class ParsedOutput:
    reasoning: str
    content: str
    tool_calls: list[ToolCall]


def parse_output(text: str, *, reasoning: bool = False, tools: list[dict] | None = None) -> ParsedOutput:
    """The whole output at once (the same result as feeding it in any chunks)."""
    parser = OutputParser(reasoning=reasoning, tools=tools)
    out = parser.feed(text)
    out += parser.finish()
    return ParsedOutput(out.reasoning, out.content, out.tool_calls)
