"""Chat-template rendering, byte-identical to transformers' `apply_chat_template(..., tokenize=False)`.

Mirrors transformers 5.x `utils/chat_template_utils.py`: a sandboxed jinja environment with
`trim_blocks`, `lstrip_blocks` and the loop-controls extension; a `tojson` filter that keeps non-ASCII
text; the `raise_exception` and `strftime_now` globals; messages with `None` values dropped and the
reasoning aliases (`reasoning_content`, `thinking`, `reasoning`) filled in; everything the template
sees rebuilt from plain JSON-like data.
"""

import functools
import json
from collections.abc import Mapping
from datetime import datetime

import jinja2
import jinja2.ext
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may be given under; templates read the first one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own filter escapes HTML characters; transformers' does not, and exposes these options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template syntax error at line {e.lineno}: {e.message}") from e


def _plain(value):
    """Rebuild `value` from plain JSON-like types, so the sandbox never sees rich objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, (str, int, float)):  # subclasses such as enums: strip back to the base type
        return next(t for t in (str, int, float) if isinstance(value, t))(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _prepare_message(index: int, message) -> dict:
    if not isinstance(message, Mapping):
        raise TypeError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    message = _plain({k: v for k, v in message.items() if v is not None})
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def check_messages(messages) -> None:
    """Refuses, with a ValueError naming the message, what a template would render as nothing without a word: a
    message without a string `role`, or without `content` (a string, or a list of content parts). An assistant
    message with `tool_calls` may leave its content out (None), as in OpenAI's API."""
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            continue  # render() refuses it, naming its type
        role = m.get("role")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role is {'missing' if role is None else 'not a string'}: every message "
                             "needs a role (system, user, assistant or tool)")
        content = m.get("content")
        if content is None:
            if role == "assistant" and m.get("tool_calls") is not None:
                continue
            raise ValueError(f"messages[{i}] ({role}) has no content: every message needs a 'content' (a string, "
                             "or a list of content parts; only an assistant message with tool_calls may leave it out)")
        if not isinstance(content, (str, list, tuple)):
            raise ValueError(f"messages[{i}].content must be a string or a list of content parts, got "
                             f"{type(content).__name__}")


def render(template: str, messages: list[dict], tools: list[dict] | None = None,
           add_generation_prompt: bool = True, **template_kwargs) -> str:
    """Render `messages` (and optional JSON-schema `tools`) with the jinja chat `template`.

    `template_kwargs` become template variables (e.g. `enable_thinking=False`, `preserve_thinking=True`,
    and the tokenizer's `bos_token`/`eos_token`/... as transformers passes them).
    Raises ValueError for template errors, including the template's own `raise_exception`.
    """
    if tools is not None:
        for i, tool in enumerate(tools):
            if not isinstance(tool, Mapping):
                raise TypeError(f"tools[{i}] must be a JSON-schema dict, got {type(tool).__name__}")
    messages = [_prepare_message(i, m) for i, m in enumerate(messages)]
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, tools=_plain(tools), documents=None,
                               add_generation_prompt=add_generation_prompt, **_plain(template_kwargs))
    except (jinja2.TemplateError, TypeError) as e:
        raise ValueError(f"chat template error: {e}") from e
