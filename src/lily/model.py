"""Model and Session: the Python face of the compiled core (lily._core)."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from lily import _core
from lily.loader import Checkpoint, load_checkpoint
from lily.tokenizer import Tokenizer



def as_tokens(ids) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(ids, dtype=np.int64).reshape(-1))
    if a.size and (a.min() < 0 or a.max() >= 2**31):
        raise ValueError("token ids must be non-negative 32-bit integers")
    return a.astype(np.int32)


class Model:
    """A loaded model: weights on a backend, its tokenizer, chat template and generation defaults."""

    def __init__(self, ckpt: Checkpoint, backend: str = "cpu", disable=None):
        self.path: Path | None = ckpt.model_dir
        self.config: dict = ckpt.config
        self.generation_config: dict = ckpt.generation_config
        if ckpt.tokenizer_json is not None:
            self.tokenizer = Tokenizer.from_json(ckpt.tokenizer_json, chat_template=ckpt.chat_template)
        else:
            self.tokenizer = Tokenizer.from_dir(ckpt.model_dir)
        rope_type = ckpt.config.get("rope_parameters", {}).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"config.json: rope_parameters.rope_type {rope_type!r} is not supported yet "
                             "(Lily implements the default partial RoPE; YaRN is opt-in and not needed below 262144 tokens)")
        core_config = {k: v for k, v in ckpt.config.items() if isinstance(v, (int, float, bool))}
        self.core = _core.Model(core_config, ckpt.tensors, ckpt.files, backend, disabled_optimisations(disable))
        self.backend: str = self.core.backend
        self.vocab_size: int = ckpt.config["vocab_size"]
        # Ids the tokenizer does not know are vocabulary padding (architecture.md §7): never sampled.
        self.n_valid = min(self.vocab_size, self.tokenizer.vocab_size)
        eos = ckpt.generation_config.get("eos_token_id") or []
        if not eos:
            eos = [i for i in (self.tokenizer.token_to_id("<|im_end|>"), self.tokenizer.token_to_id("<|endoftext|>"))
                   if i is not None]
        self.eos_token_ids: list[int] = [int(i) for i in eos]

    @property
    def disabled(self) -> list[str]:
        """The optimisations turned off for this model (lily.optimisations() lists them all)."""
        return [n for n in self.core.disabled.split(",") if n]

    def session(self, max_context: int | None = None, prefill_chunk: int | None = None) -> Session:
        """A new multi-turn session that keeps its state between calls. prefill_chunk (tokens per forward call
        while prefilling; bounds working memory) defaults to the backend's own choice."""
        return Session(self, max_context, prefill_chunk)

    def logits(self, token_ids, prefill_chunk: int | None = None) -> np.ndarray:
        """fp32 logits of every position, [T, vocab], from an empty state (teacher forcing)."""
        tokens = as_tokens(token_ids)
        if tokens.size == 0:
            raise ValueError("logits() needs at least one token")
        s = self.core.session(max_context=self.config["max_position_embeddings"], prefill_chunk=prefill_chunk or 0)
        return s.forward_all(tokens)

    def encode_prompt(self, prompt, *, tools=None, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """Token ids of a prompt: a string, a list of ids, or a list of chat messages (rendered by the template)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        prompt = list(prompt)
        if prompt and isinstance(prompt[0], dict):
            text = self.tokenizer.apply_chat_template(prompt, tools=tools, add_generation_prompt=add_generation_prompt,
                                                      **template_kwargs)
            return self.tokenizer.encode(text)
        return [int(t) for t in prompt]

    def __repr__(self) -> str:
        c = self.config
        return (f"lily.Model({self.path or 'in-memory'}, backend={self.backend}, layers={c['num_hidden_layers']}, "
                f"hidden={c['hidden_size']}, experts={c['num_experts']}, vocab={c['vocab_size']})")


class Session:
    """The state of one conversation. A prompt that extends the tokens already in the session only prefills
    its new tokens; any other prompt starts over.

    Chat: after a reply to a list of messages, the session remembers that conversation. A later call whose
    messages extend it (the same messages, the reply as the assistant's content, then new messages) continues
    the token stream instead of re-rendering the history: the reply's own tokens stay in the state (reasoning
    included, as mlx-lm's and llama.cpp's chat loops keep it) and only the new messages are prefilled."""

    def __init__(self, model: Model, max_context: int | None, prefill_chunk: int | None):
        self.model = model
        self.core = model.core.session(max_context=max_context or 0, prefill_chunk=prefill_chunk or 0)
        self.tokens: list[int] = []  # tokens whose effect is in the state
        self.messages: list[dict] | None = None  # the conversation the state holds, reply last
        self.pending: int | None = None  # the reply's last token, sampled but not yet in the state
        self.ended_on_eos = False

    def continuation(self, messages: list[dict], tools=None, **template_kwargs) -> list[int] | None:
        """Prompt ids that continue the stored conversation with the new messages, or None if `messages` does
        not extend it (or the template cannot render the new messages on their own)."""
        old = self.messages
        if not old or len(messages) <= len(old) or not self.tokens:
            return None
        for new, prev in zip(messages, old):
            same_reply = prev is old[-1] and new.get("role") == "assistant" and new.get("content") == prev["content"]
            if new != prev and not same_reply:
                return None
        tok = self.model.tokenizer
        tail = [] if self.pending is None else [self.pending]
        tail += tok.encode("\n" if self.ended_on_eos else "<|im_end|>\n")
        try:
            text = tok.apply_chat_template(messages[len(old):], tools=tools, add_generation_prompt=True,
                                           **template_kwargs)
        except ValueError:
            return None
        return self.tokens + tail + tok.encode(text)

    @property
    def max_context(self) -> int:
        return self.core.max_context

    def reuse(self, prompt: list[int]) -> int:
        """Prepares the state for `prompt`; returns how many of its tokens are already in the state."""
        n = len(self.tokens)
        if 0 < n < len(prompt) and prompt[:n] == self.tokens:
            return n
        self.reset()
        return 0

    def reset(self) -> None:
        self.core.reset()
        self.tokens = []
        self.messages, self.pending, self.ended_on_eos = None, None, False

    def snapshot(self) -> tuple[_core.Snapshot, list[int]]:
        return self.core.snapshot(), list(self.tokens)

    def restore(self, snap: tuple[_core.Snapshot, list[int]]) -> None:
        state, tokens = snap
        self.core.restore(state)
        self.tokens = list(tokens)
        self.messages, self.pending, self.ended_on_eos = None, None, False

    def prefill(self, token_ids) -> np.ndarray:
        """Feeds tokens; returns the fp32 logits of the last one."""
        tokens = as_tokens(token_ids)
        out = self.core.prefill(tokens)
        self.tokens.extend(int(t) for t in tokens)
        self.messages, self.pending = None, None
        return out

    def feed(self, token_ids) -> None:
        """Feeds tokens and computes no logits (no lm_head, nothing copied back): for prompt prefixes."""
        tokens = as_tokens(token_ids)
        self.core.feed(tokens)
        self.tokens.extend(int(t) for t in tokens)
        self.messages, self.pending = None, None

    def generate(self, prompt, **kwargs) -> str:
        from lily.generate import generate

        return generate(self.model, prompt, session=self, **kwargs)

    def stream_generate(self, prompt, **kwargs):
        from lily.generate import stream_generate

        return stream_generate(self.model, prompt, session=self, **kwargs)


def optimisations() -> list[tuple[str, str, str]]:
    """The ablation switches: (name, backends it changes, what it does). Each is on unless turned off with
    `lily.load(..., disable=[name, ...])` or the environment variable LILY_DISABLE=name,name (read when a model
    is created); off means the plain path the tests also run."""
    return list(_core.optimisations())


def disabled_optimisations(disable=None) -> list[str]:
    """The switch names to turn off: `disable` (names, or one comma-separated string) plus LILY_DISABLE."""
    names = [disable] if isinstance(disable, str) else list(disable or [])
    names += os.environ.get("LILY_DISABLE", "").split(",")
    out = []
    for n in names:
        for part in str(n).split(","):
            if part.strip() and part.strip() not in out:
                out.append(part.strip())
    return out


def load(path_or_id: str | Path, backend: str = "cpu", revision: str | None = None, disable=None) -> Model:
    """Loads a qwen3_5_moe MLX checkpoint from a directory or a Hugging Face hub id (downloaded and cached).
    `"tiny"` is Lily's built-in random model in the real architecture (no files, works offline). `disable`
    turns optimisations off by name (see lily.optimisations())."""
    if str(path_or_id) == "tiny":
        from lily.tiny import build_tiny

        return Model(build_tiny(), backend, disable)
    return Model(load_checkpoint(path_or_id, revision=revision), backend, disable)
