"""Tokenizer: a `tokenizers.Tokenizer` wrapper with the chat template and a UTF-8-safe streaming decoder."""

import codecs
import functools
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders

from lily import chat

# Named special tokens that transformers passes to chat templates (its `special_tokens_map`).
_TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Texts at least this long are encoded with the GIL released (Tokenizer.encode).
_GIL_FREE_CHARS = 1 << 14


def _byte_level_char_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte→printable-character map used by the ByteLevel pre-tokenizer and decoder."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON: {e}") from e


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, null, or a serialised AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


class StreamingDetokenizer:
    """Incremental decoding of a token stream, O(1) work per token.

    `add` returns only completed characters: a byte-level token may end in the middle of a multi-byte
    UTF-8 character, whose bytes are held back until a later token completes it. The concatenation of
    all `add` results and `flush` equals `Tokenizer.decode` of the whole sequence.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Feed one token id; return the text it completes (possibly empty)."""
        return self._utf8.decode(self._token_bytes(token_id))

    def flush(self) -> str:
        """Return the held-back tail, with U+FFFD for an incomplete character, and reset."""
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """A byte-level BPE tokenizer (tokenizer.json) plus the model's chat template. No BOS is added."""

    def __init__(self, tok: tokenizers.Tokenizer, chat_template: str | None = None,
                 template_tokens: dict[str, str] | None = None):
        self._tok = tok
        self.chat_template = chat_template
        self._template_tokens = dict(template_tokens or {})
        self._special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
        self._char_to_byte = _byte_level_char_to_byte() if isinstance(tok.decoder, decoders.ByteLevel) else None

    @classmethod
    def from_json(cls, tokenizer_json: str, chat_template: str | None = None) -> "Tokenizer":
        try:
            tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # the Rust parser raises a bare Exception
            raise ValueError(f"invalid tokenizer JSON: {e}") from e
        return cls(tok, chat_template)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load tokenizer.json, plus tokenizer_config.json and chat_template.jinja when present.

        As in transformers, chat_template.jinja takes precedence over tokenizer_config.json's template.
        """
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: tokenizer.json not found in {model_dir}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust parser raises a bare Exception
            _read_json(path)  # a plain JSON error is reported as such
            raise ValueError(f"{path}: not a valid tokenizer: {e}") from e

        chat_template, template_tokens = None, {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            config = _read_json(config_path)
            if not isinstance(config, dict):
                raise ValueError(f"{config_path}: expected a JSON object")
            _check_added_tokens(tok, config.get("added_tokens_decoder", {}), config_path)
            chat_template = _default_template(config.get("chat_template"), config_path)
            template_tokens = {name: content for name in _TEMPLATE_TOKEN_NAMES
                               if (content := _token_content(config.get(name))) is not None}
        template_path = model_dir / "chat_template.jinja"
        if template_path.is_file():
            chat_template = template_path.read_text(encoding="utf-8")
        return cls(tok, chat_template, template_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; added tokens written in the text (e.g. `<think>`) become single ids."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        try:
            if len(text) < _GIL_FREE_CHARS:
                return self._tok.encode(text, add_special_tokens=False).ids
            # encode() holds the GIL throughout; encode_batch() releases it (same ids), so that a long prompt does not
            # freeze the process's other threads (the server's event loop) while it is tokenised.
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        except TypeError:  # the Rust side takes only valid Unicode: a lone surrogate (from a "\ud800" escape) is not
            bad = re.search("[\ud800-\udfff]", text)
            if bad is None:
                raise
            raise ValueError(f"the text holds a lone UTF-16 surrogate ({bad.group()!a}) at character {bad.start()}, "
                             "which is not Unicode text") from None

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) in linear time, about ten times cheaper than encoding: byte-level BPE
        splits the normalised text's UTF-8 bytes among tokens, none holding more bytes (or characters) than the
        longest token of the vocabulary. 0 for a tokenizer that is not byte-level."""
        if self._longest_token is None:
            return 0
        if self._tok.normalizer is not None:
            text = self._tok.normalizer.normalize_str(text)
        most_bytes, most_chars = self._longest_token
        return max(-(-len(text.encode("utf-8", "surrogatepass")) // most_bytes), -(-len(text) // most_chars))

    @functools.cached_property
    def _longest_token(self) -> tuple[int, int] | None:
        """(bytes, characters) of the longest token, counting a character where its first UTF-8 byte is; None when
        some byte has no token of its own (text could then be dropped, and no bound holds)."""
        if self._char_to_byte is None:
            return None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        if any(c not in vocab for c in self._char_to_byte):
            return None
        most_bytes = most_chars = 1
        for token_id in vocab.values():
            data = self._token_bytes(token_id, skip_special_tokens=False)
            most_bytes = max(most_bytes, len(data))
            most_chars = max(most_chars, sum(b & 0xC0 != 0x80 for b in data))
        return most_bytes, most_chars

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Special added tokens are dropped if asked; `<think>` and tool tags are not special."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"token ids must be >= 0, got {min(ids)}")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token adds to decoded text (special tokens included): part of a character's UTF-8 where
        the vocabulary splits a character over tokens, so not always text on its own."""
        return self._token_bytes(token_id, skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **kwargs) -> str:
        """Render a conversation to prompt text, as transformers' `apply_chat_template(tokenize=False)`. Lily is
        stricter in one way: a message without content is a ValueError (chat.check_messages), not an empty turn."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (no chat_template.jinja, no chat_template in "
                             "tokenizer_config.json), so chat messages cannot be rendered: give the prompt as text or "
                             "token ids instead (on the command line: lily generate --raw)")
        chat.check_messages(messages)
        return chat.render(self.chat_template, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           **{**self._template_tokens, **kwargs})

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming decoder for one generated sequence."""
        if self._char_to_byte is None:
            raise ValueError(f"streaming decode needs a ByteLevel decoder, the tokenizer has {self._tok.decoder}")
        return StreamingDetokenizer(functools.partial(self._token_bytes, skip_special_tokens=skip_special_tokens))

    def _token_bytes(self, token_id: int, skip_special_tokens: bool) -> bytes:
        """The bytes one token contributes to decoded text, by the ByteLevel decoder's rule.

        Every character maps back to its byte; a token with a character outside the map (an added
        token containing a space, say) contributes its UTF-8 text. Ids unknown to the tokenizer
        (embedding padding rows) contribute nothing, as in `decode`.
        """
        if token_id < 0:
            raise ValueError(f"token id must be >= 0, got {token_id}")
        token = self._tok.id_to_token(token_id)
        if token is None or (skip_special_tokens and token_id in self._special_ids):
            return b""
        if all(c in self._char_to_byte for c in token):
            return bytes(self._char_to_byte[c] for c in token)
        return token.encode("utf-8")


def _check_added_tokens(tok: tokenizers.Tokenizer, added_tokens_decoder: dict, config_path: Path) -> None:
    """tokenizer_config.json's added tokens must sit at the same ids as in tokenizer.json; add missing ones."""
    for id_str, entry in added_tokens_decoder.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str) or not id_str.isdigit():
            raise ValueError(f"{config_path}: malformed added_tokens_decoder entry {id_str!r}: {entry!r}")
    for id_str, entry in sorted(added_tokens_decoder.items(), key=lambda kv: int(kv[0])):
        content = entry["content"]
        if tok.token_to_id(content) is None:
            tok.add_tokens([tokenizers.AddedToken(
                content, special=entry.get("special", False), normalized=entry.get("normalized", False),
                lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                single_word=entry.get("single_word", False))])
        if tok.token_to_id(content) != int(id_str):
            raise ValueError(f"{config_path}: added token {content!r} has id {id_str} there, "
                             f"but {tok.token_to_id(content)} in tokenizer.json")


def _default_template(value, config_path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates (use 'default')."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        templates = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in templates:
            return templates["default"]
    raise ValueError(f"{config_path}: chat_template must be a string or a list with a 'default' template")
