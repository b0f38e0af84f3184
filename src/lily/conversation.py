"""A conversation as a session's state holds it after a reply, and the prompt that continues it.

After a reply the state holds the prompt and the reply's tokens as the model produced them (reasoning and tool-call
text included, as mlx-lm's and llama.cpp's chat loops keep them), all but perhaps the reply's last token, sampled
and not yet fed. A next turn whose messages extend the conversation (the same messages, the reply as the assistant's
message, then new ones) continues from there: its prompt is the tokens held, the end of the reply's turn, and the new
messages rendered as the turns that follow an assistant turn. Nothing of the history is rendered or read again.
A reply that a stop string or an end-of-sequence token other than <|im_end|> ended is not continued (reply_end):
the state then holds text that the conversation's messages do not.

`Conversation` is that record; `Session` (lily.model) keeps the one its state holds, and the server's engine keeps
many (`Conversations`, one session serving every client), so that all of them continue a conversation the same way.
The server continues one only where the chat template, rendering the request whole, keeps the reply's thinking
block as the state holds it (Conversation.keeps_thinking: a tool result after the reply, not a new user message,
with Qwen's template): a request's prompt is then what the template makes of it, whatever the server served before.
"""
from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

TURN_END = "<|im_end|>\n"  # how the Qwen chat template closes every turn
# Stand-ins for the turns before the new messages, rendered and cut away again (turns_after_reply).
_BEFORE = [{"role": "user", "content": "\u2063lily-user\u2063"}, {"role": "assistant", "content": "\u2063lily-reply\u2063"}]
_THOUGHT = "\u2063lily-thought\u2063"  # a stand-in reply's reasoning (keeps_thinking)


def reply_end(last: int | None, eos_ids, turn_end_id: int | None, by_stop_string: bool,
              eos_ignored_in=()) -> bool | None:
    """How a reply ended, for continuing its conversation from the state after it: True when it closed its turn itself
    (its last token is the turn's end, <|im_end|>), False when it was cut off (max_tokens, an interrupt: the
    continuation closes the turn), None when the state cannot continue it as the chat template renders the
    conversation: a stop string ended it (the state holds the stop text, which the caller never got), another
    end-of-sequence token did (the template closes every turn with <|im_end|>), or the reply ran on past one
    (`eos_ignored_in`: the reply's tokens under ignore_eos; the state holds what followed the turn's end)."""
    if by_stop_string or any(t in eos_ids for t in eos_ignored_in):
        return None
    if last is not None and last in eos_ids:
        return True if last == turn_end_id else None
    return False


def turn_end_id(tokenizer) -> int | None:
    return tokenizer.token_to_id(TURN_END[:-1])


def turns_after_reply(tokenizer, messages: list[dict], tools=None, template_kwargs: dict | None = None) -> str | None:
    """The text the chat template gives `messages` (with the generation prompt) where they follow an assistant
    turn: rendered after stand-in turns, which are then cut away, so that the template sees them in context (a tool
    result after the assistant's call, the tools' system block already given). None where the template renders
    them some other way (it refuses them, or the stand-ins do not close where expected)."""
    try:
        text = tokenizer.apply_chat_template(_BEFORE + list(messages), tools=tools, add_generation_prompt=True,
                                             **(template_kwargs or {}))
    except ValueError:
        return None
    reply = text.find(_BEFORE[1]["content"])
    end = text.find(TURN_END, reply)
    if reply < 0 or end < 0 or "\u2063lily-" in text[end:]:
        return None
    return text[end + len(TURN_END):]


def _reply_key(message: dict) -> tuple:
    """What of an assistant message must agree with the reply recorded: its text and its calls. Reasoning may be
    left out (clients often drop it) and call ids differ; the state holds the reply as it was generated anyway."""
    calls = []
    for call in message.get("tool_calls") or ():
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        calls.append((fn.get("name"), json.dumps(args, sort_keys=True)))
    return message.get("role"), message.get("content") or "", calls


@dataclass(frozen=True, eq=False)
class Conversation:
    """A conversation the state held right after a reply: its messages (chat-template terms, the reply last), the
    tools and template arguments it was rendered with, the tokens the state held, the reply's last token if it was
    not fed (`pending`), and whether the reply closed its turn itself (reply_end). Messages, tools and arguments
    are copied: a caller who edits its own lists and dicts afterwards changes another conversation, not this one."""
    messages: tuple
    tools: list | None
    template_kwargs: dict
    tokens: np.ndarray  # int32
    pending: int | None
    closed_turn: bool

    def __post_init__(self):
        for name in ("messages", "tools", "template_kwargs"):
            object.__setattr__(self, name, copy.deepcopy(getattr(self, name)))

    def extended_by(self, messages: list[dict], tools=None, template_kwargs: dict | None = None) -> bool:
        """True if `messages` are this conversation's (the reply as its assistant message) and then more, rendered
        with the same tools and template arguments."""
        old = self.messages
        if len(messages) <= len(old) or tools != self.tools or (template_kwargs or {}) != self.template_kwargs:
            return False
        return list(messages[:len(old) - 1]) == list(old[:-1]) and _reply_key(messages[len(old) - 1]) == _reply_key(
            old[-1])

    def continuation(self, tokenizer, messages: list[dict]) -> tuple[list[int], str] | None:
        """(prompt ids, the text of the new turns) continuing this conversation with messages[len(self.messages):]
        (the caller checked extended_by), or None if the template cannot render those turns on their own."""
        text = turns_after_reply(tokenizer, messages[len(self.messages):], self.tools, self.template_kwargs)
        if text is None:
            return None
        tail = [] if self.pending is None else [self.pending]
        tail += tokenizer.encode("\n" if self.closed_turn else TURN_END)
        return self.tokens.tolist() + tail + tokenizer.encode(text), text

    def keeps_thinking(self, tokenizer, messages: list[dict]) -> bool:
        """Whether the chat template, rendering `messages` whole, renders this conversation's reply with its thinking
        block, as the state holds it (the reasoning as generated, or the empty block of a reply without thinking).
        Qwen's template drops the block of every reply before the last user message (unless `preserve_thinking`), so
        a new user message after the reply makes the state's tokens another prompt than the request's; a tool
        result does not. Rendered with a stand-in reply whose reasoning is looked for."""
        probe = [_BEFORE[0], {"role": "assistant", "content": _BEFORE[1]["content"], "reasoning_content": _THOUGHT}]
        try:
            text = tokenizer.apply_chat_template(probe + list(messages[len(self.messages):]), tools=self.tools,
                                                 add_generation_prompt=True, **self.template_kwargs)
        except ValueError:
            return False
        return _THOUGHT in text


def _prefix_hasher(tools, template_kwargs: dict | None):
    h = hashlib.sha256()
    h.update(json.dumps([tools, template_kwargs or {}], sort_keys=True, default=str).encode())
    return h


class Conversations:
    """The conversations an engine's state held after its replies, the `max_entries` most recent, found by their
    messages: a request whose messages extend one continues its state (Conversation.continuation), whichever API
    it came by. Thread-safe."""

    def __init__(self, max_entries: int = 256):
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(h, reply: dict) -> bytes:
        h = h.copy()
        h.update(json.dumps(_reply_key(reply), sort_keys=True, default=str).encode())
        return h.digest()

    def record(self, conversation: Conversation) -> None:
        msgs = conversation.messages
        h = _prefix_hasher(conversation.tools, conversation.template_kwargs)
        for m in msgs[:-1]:
            h.update(json.dumps(m, sort_keys=True, default=str).encode() + b"\0")
        key = self._key(h, msgs[-1])
        with self._lock:
            self._entries[key] = conversation
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def find(self, messages: list[dict], tools=None, template_kwargs: dict | None = None) -> Conversation | None:
        """The longest recorded conversation that `messages` extend, or None."""
        h, keys = _prefix_hasher(tools, template_kwargs), []
        for i, m in enumerate(messages[:-1]):
            if m.get("role") == "assistant":
                keys.append(self._key(h, m))
            h.update(json.dumps(m, sort_keys=True, default=str).encode() + b"\0")
        with self._lock:
            for key in reversed(keys):
                conv = self._entries.get(key)
                if conv is not None and conv.extended_by(messages, tools, template_kwargs):
                    self._entries.move_to_end(key)
                    return conv
        return None
