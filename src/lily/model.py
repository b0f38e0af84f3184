"""Model and Session: the Python face of the compiled core (lily._core)."""
from __future__ import annotations

import contextlib
import copy
import os
import threading
from pathlib import Path
from typing import Callable

import numpy as np

from lily import _core
from lily._core import SessionConflictError


class ContextLimitError(ValueError):
    """A prompt that does not fit in the session's context limit (after what the session already holds): refused
    before anything is read, with the session unchanged."""
from lily.backend import resolve_backend
from lily.conversation import Conversation
from lily.loader import Checkpoint, load_checkpoint
from lily.safetensors_io import CheckpointChangedError
from lily.tokenizer import Tokenizer


def as_tokens(ids, what: str = "token ids") -> np.ndarray:
    """Token ids as a contiguous int32 array: a 1-D sequence of Python or NumPy integers (a NumPy integer array is
    taken as is). Anything else raises ValueError naming the problem: a float (1.9 is no id), a string, a bool, a
    nested or 2-D input, an id outside [0, 2**31)."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{what} must be a sequence of integers, got a {type(ids).__name__}")
    if isinstance(ids, np.ndarray):
        a = ids
        if a.dtype.kind not in "iu":
            raise ValueError(f"{what} must be integers, got an array of {a.dtype}")
    else:
        try:
            items = list(ids)
        except TypeError:
            raise ValueError(f"{what} must be a sequence of integers, got {type(ids).__name__}") from None
        if set(map(type, items)) - {int}:  # the usual case, plain ints, needs no look at each item
            for i, t in enumerate(items):
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                    raise ValueError(f"{what}[{i}] must be an integer, got {type(t).__name__} {t!r:.40}")
        try:
            a = np.array(items, dtype=np.int64)
        except OverflowError:
            a = None
        if a is None or (a.size and (a.min() < 0 or a.max() >= 2**31)):
            i = next(i for i, t in enumerate(items) if not 0 <= t < 2**31)
            raise ValueError(f"{what}[{i}] = {items[i]} is outside [0, 2**31)")
    if a.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional, got shape {a.shape}")
    if a.size and (a.min() < 0 or a.max() >= 2**31):
        i = int(np.argmax((a < 0) | (a >= 2**31)))
        raise ValueError(f"{what}[{i}] = {a[i]} is outside [0, 2**31)")
    return np.ascontiguousarray(a, dtype=np.int32)


def _size_arg(where: str, name: str, value, limit: int) -> int:
    """A session size argument as the core's int: None or 0 (the default) is 0; anything but an integer in
    [1, limit] raises ValueError naming the argument and the limit (not nanobind's signature, nor a negative
    value silently taken for the default)."""
    if value is None:
        return 0
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= value <= limit:
        got = value if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)) \
            else f"{type(value).__name__} {value!r:.40}"
        raise ValueError(f"{where}: {name} must be None or an integer in [1, {limit}], got {got}")
    return int(value)


class Model:
    """A loaded model: weights on a backend, its tokenizer, chat template and generation defaults.

    The core keeps every weight array alive (clearing or changing the checkpoint's dict frees nothing it reads). On
    the CPU it reads the mapped safetensors files in place: they must not be overwritten while the model lives
    (`check_files`, called before every generation, refuses with CheckpointChangedError if one was)."""

    def __init__(self, ckpt: Checkpoint, backend: str | None = None, disable=None):
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
        try:
            self.core: _core.Model = _core.Model(core_config, ckpt.tensors, ckpt.files, resolve_backend(backend),
                                    {str(f.path): f.view for f in ckpt.mapped}, disabled_optimisations(disable))
        except ValueError as e:  # the checkpoint named, where the core's message does not already
            if type(e) is ValueError and ckpt.model_dir is not None and str(ckpt.model_dir) not in str(e):
                raise ValueError(f"{ckpt.model_dir}: {e}") from None
            raise
        self.backend: str = self.core.backend
        self.device: str = self.core.device  # what the backend runs on ("NVIDIA H200"; the backend's name if none)
        # The files the backend reads in place for as long as the model lives (none where it copied the weights).
        self.mapped_files = list(ckpt.mapped) if self.core.reads_host_weights else []
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

    @property
    def fingerprint(self) -> str:
        """The identity of the weights (32 hex digits): config, tensor names, dtypes and shapes, and sampled bytes
        of every tensor; independent of file names and times. Snapshots carry it and restore only into a model
        with the same one."""
        return self.core.fingerprint

    def check_files(self) -> None:
        """Raises CheckpointChangedError, naming the file, if a weights file this model reads in place was
        overwritten or truncated since load (its size, modification or status-change time differs). A file
        replaced by a rename is no change: the model still reads the file it mapped."""
        for f in self.mapped_files:
            what = f.changed()
            if what is not None:
                raise CheckpointChangedError(
                    f"{f.path}: the weights file changed on disk while the model was reading it in place ({what}); "
                    "its weights in memory may be corrupt: load the model again (to replace a weights file under a "
                    "running model, write a new file and rename it over the old one)")

    def session(self, max_context: int | None = None, prefill_chunk: int | None = None) -> Session:
        """A new multi-turn session that keeps its state between calls. prefill_chunk (tokens per forward call
        while prefilling; bounds working memory) defaults to the backend's own choice."""
        return Session(self, max_context, prefill_chunk)

    def logits(self, token_ids, prefill_chunk: int | None = None) -> np.ndarray:
        """fp32 logits of every position, [T, vocab], from an empty state (teacher forcing)."""
        tokens = as_tokens(token_ids)
        if tokens.size == 0:
            raise ValueError("logits() needs at least one token")
        chunk = _size_arg("Model.logits", "prefill_chunk", prefill_chunk, 2**31 - 1)
        self.check_files()
        s = self.core.session(max_context=self.config["max_position_embeddings"], prefill_chunk=chunk)
        return s.forward_all(tokens)

    def encode_prompt(self, prompt, *, tools=None, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """Token ids of a prompt: a string, a sequence of ids, or a list of chat messages (rendered by the
        template)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            text = self.tokenizer.apply_chat_template(list(prompt), tools=tools,
                                                      add_generation_prompt=add_generation_prompt, **template_kwargs)
            return self.tokenizer.encode(text)
        return as_tokens(prompt, "prompt token ids").tolist()

    def __repr__(self) -> str:
        c = self.config
        return (f"lily.Model({self.path or 'in-memory'}, backend={self.backend} ({self.device}), "
                f"layers={c['num_hidden_layers']}, "
                f"hidden={c['hidden_size']}, experts={c['num_experts']}, vocab={c['vocab_size']})")


class Session:
    """The state of one conversation. A prompt that extends the tokens already in the session only prefills
    its new tokens; any other prompt starts over.

    Chat: after a reply to a list of messages, the session remembers that conversation. A later call whose
    messages extend it (the same messages, the reply as the assistant's content, then new messages) continues
    the token stream instead of re-rendering the history: the reply's own tokens stay in the state (reasoning
    included, as mlx-lm's and llama.cpp's chat loops keep it) and only the new messages are prefilled.

    One conversation, never shared: concurrent use is refused, not serialised. A call made while another thread
    is inside the session raises SessionConflictError, and a generation whose session was changed between its
    steps (by prefill, reset, restore or another generation, in any thread) raises SessionConflictError at its
    next step. Give each thread its own session (they may share the Model), or hold a lock around the calls."""

    def __init__(self, model: Model, max_context: int | None, prefill_chunk: int | None):
        self.model = model
        max_context = _size_arg("Model.session", "max_context", max_context, model.config["max_position_embeddings"])
        prefill_chunk = _size_arg("Model.session", "prefill_chunk", prefill_chunk, 2**31 - 1)
        self.core: _core.Session = model.core.session(max_context=max_context, prefill_chunk=prefill_chunk)
        self.conversation: Conversation | None = None  # the chat the state holds, right after its reply
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def exclusive(self):
        """Holds the session for the current thread (nestable); SessionConflictError if another thread holds it.
        Each call that changes `tokens` and the state together runs inside it, so they never disagree."""
        if not self._lock.acquire(blocking=False):
            raise SessionConflictError("this session is in use by another thread: a session holds one conversation "
                                       "and is never shared (give each thread its own session, or serialise the "
                                       "calls with a lock)")
        try:
            yield
        finally:
            self._lock.release()

    @property
    def tokens(self) -> list[int]:
        """The tokens whose effect is in the state, in order (a copy: the core's session owns them)."""
        return self.core.tokens

    @property
    def messages(self) -> list[dict] | None:
        """The conversation the state holds, its reply last (None when the state holds no chat reply); a copy."""
        return None if self.conversation is None else copy.deepcopy(list(self.conversation.messages))

    def continuation(self, messages: list[dict], tools=None, **template_kwargs) -> list[int] | None:
        """Prompt ids that continue the stored conversation with the new messages, or None if `messages` does
        not extend it (or the template cannot render the new messages on their own)."""
        conv = self.conversation
        if conv is None or not conv.extended_by(messages, tools, template_kwargs) or \
                len(conv.tokens) != self.core.position:
            return None
        found = conv.continuation(self.model.tokenizer, messages)
        return None if found is None else found[0]

    @property
    def max_context(self) -> int:
        return self.core.max_context

    def reuse(self, prompt: list[int]) -> int:
        """Prepares the state for `prompt`; returns how many of its tokens are already in the state."""
        with self.exclusive():
            held = self.core.tokens
            if 0 < len(held) < len(prompt) and prompt[:len(held)] == held:
                return len(held)
            self.reset()
            return 0

    def reset(self) -> None:
        with self.exclusive():
            self.core.reset()
            self.conversation = None

    def reserve(self, tokens: int) -> None:
        """Makes room for `tokens` more positions at once (the KV caches are grown once, not as they fill): for a
        caller that feeds a prompt in parts and knows the whole, as the server's engine does."""
        with self.exclusive():
            self.core.reserve(tokens)

    def snapshot(self) -> _core.Snapshot:
        """The state and the tokens it holds (Snapshot.tokens), for restore(); it carries the model's fingerprint.
        It lives in the backend's memory where there is room: a device copy of the used state, no host round trip."""
        with self.exclusive():
            return self.core.snapshot()

    def restore(self, snapshot: _core.Snapshot) -> None:
        """Restores a snapshot from snapshot() or a PrefixCache, with its tokens. ValueError, with the session
        unchanged, for a snapshot of another model or geometry, or more tokens than the session's context."""
        with self.exclusive():
            self.core.restore(snapshot)
            self.conversation = None

    def prefill(self, token_ids, progress: Callable[[int, int], object] | None = None) -> np.ndarray:
        """Feeds tokens; returns the fp32 logits of the last one.

        Long inputs run in chunks (prefill_chunk tokens each). `progress(done, total)`, if given, is called with
        (0, total), after every chunk, and with (total, total) at the end. Between chunks Ctrl-C is seen:
        KeyboardInterrupt (or any exception from `progress`) stops the prefill within one chunk, and the session keeps
        the chunks done: `tokens` lists exactly the tokens its state holds."""
        return self._feed(token_ids, progress, self.core.prefill)

    def feed(self, token_ids, progress: Callable[[int, int], object] | None = None) -> None:
        """Feeds tokens and computes no logits (no lm_head, nothing copied back): for prompt prefixes. Progress and
        interrupts as prefill()."""
        self._feed(token_ids, progress, self.core.feed)

    def _feed(self, token_ids, progress, call):
        tokens = as_tokens(token_ids)
        self.model.check_files()
        with self.exclusive():
            before = self.core.position
            try:
                if progress is not None:
                    progress(0, len(tokens))
                out = call(tokens, progress=progress)
                if progress is not None:
                    progress(len(tokens), len(tokens))
                return out
            finally:
                if self.core.position != before:  # all of them, or the chunks done before an interrupt
                    self.conversation = None

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


def load(path_or_id: str | Path, backend: str | None = None, revision: str | None = None, disable=None) -> Model:
    """Loads a qwen3_5_moe MLX checkpoint from a directory or a Hugging Face hub id (downloaded and cached).
    `"tiny"` is Lily's built-in random model in the real architecture (no files, works offline).

    backend: "cuda", "metal", "cpu" or "auto"; None (the default) is LILY_BACKEND when set, else "auto": the
    first of cuda, metal, cpu that can run here (lily.backends() says which can and why not). A named backend that
    cannot run here is a ValueError saying why. `disable` turns optimisations off by name (lily.optimisations())."""
    if str(path_or_id) == "tiny":
        from lily.tiny import build_tiny

        return Model(build_tiny(), backend, disable)
    return Model(load_checkpoint(path_or_id, revision=revision), backend, disable)
