"""The engine: the model, its one session and the prefix cache, driven by a worker thread that serves requests
(`Job`s) one at a time in arrival order, whatever API they came by. A request whose client goes away is cancelled
between tokens (and between the chunks of a long prefill). Before each prompt the engine restores the longest saved
prefix of it (the live session state or a `PrefixCache` snapshot), then lets the generation prefill the rest in one
call; a new conversation's opening turn, up to its first `<|im_end|>\\n`, is snapshotted on the way, inside that
call's forward passes (Session.save_at). After the reply it snapshots again: a conversation continued with one more
turn (Conversations) prefills only that turn. Also the counters behind /metrics."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from lily.conversation import Conversations, reply_end, turn_end_id
from lily.generate import GenerationResponse, stream_generate
from lily.model import Model
from lily.prefix_cache import PrefixCache
from lily.safetensors_io import CheckpointChangedError
from lily.server.protocol import RequestError, Sampling

log = logging.getLogger(__name__)


class _Cancelled(Exception):
    """Raised between prefill chunks when the job's client went away or the server is closing."""


@dataclass
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str

    def to_openai(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class Prompt:
    ids: list[int]
    text: str  # the prompt's text; for a continued conversation, the text of its new turns


@dataclass
class Held:
    """What the state held when a job's reply was complete: its tokens (the prompt and the reply as fed), the reply's
    last token if it was not fed, and whether the reply closed its turn itself (conversation.reply_end)."""
    tokens: np.ndarray
    pending: int | None
    closed_turn: bool


class Job:
    """One request for the engine. Its events reach the event loop as (kind, value): ("accepted", Prompt),
    ("token", GenerationResponse) per token, then ("done", Usage) or ("error", RequestError). By "done", `held`
    says what the state held after the reply (for Conversations)."""

    def __init__(self, prompt_fn: Callable[[Model], Prompt], sampling: Sampling, prompt_param: str):
        self.prompt_fn, self.sampling, self.prompt_param = prompt_fn, sampling, prompt_param
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.held: Held | None = None

    def emit(self, kind: str, value=None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is gone: nobody is listening
            self.cancelled.set()

    async def next(self):
        return await self.events.get()

    def cancel(self) -> None:
        self.cancelled.set()


class Metrics:
    """Counters for /metrics, updated by the HTTP layer and the engine thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: Counter = Counter()  # (endpoint, status) -> count
        self.cancelled = 0
        self.prompt_tokens = self.cached_tokens = self.prefill_tokens = self.generation_tokens = 0
        self.prefill_seconds = self.decode_seconds = 0.0
        self.last_prefill_tps = self.last_decode_tps = 0.0
        self.prefix_hits = self.prefix_misses = 0

    def count(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.requests[endpoint, status] += 1


GenerateFn = Callable[..., Iterator[GenerationResponse]]


class Engine:
    """The model, its one session and the prefix cache, driven by a worker thread that serves jobs one at a
    time in arrival order. `generate_fn(model, prompt_ids, session=, sampling=, progress=)` yields
    GenerationResponses (lily.stream_generate; tests inject scripted generators through it)."""

    def __init__(self, model: Model, *, max_context: int | None = None, cache: PrefixCache | None = None,
                 generate_fn: GenerateFn = stream_generate):
        self.model, self.cache, self.generate_fn = model, cache, generate_fn
        self.session = model.session(max_context)
        self.conversations = Conversations()  # the chats whose replies the state held: the next turn continues them
        self.max_context = self.session.max_context
        self.metrics = Metrics()
        self.running = False
        self._jobs: queue.Queue = queue.Queue()
        self._closing = False
        self._thread: threading.Thread | None = None
        self._token_text: dict[int, str] = {}
        model.tokenizer.min_tokens("")  # reads the vocabulary once, at start-up
        nl = model.tokenizer.encode("\n")
        self._turn_end = (turn_end_id(model.tokenizer), nl[0] if len(nl) == 1 else None)
        self._turn_start = model.tokenizer.token_to_id("<|im_start|>")

    @property
    def queued(self) -> int:
        return self._jobs.qsize()

    def start(self) -> None:
        if self._thread is None:
            self._closing = False
            self._thread = threading.Thread(target=self._work, name="lily-engine", daemon=True)
            self._thread.start()

    def submit(self, job: Job) -> None:
        if self._closing or self._thread is None:
            raise RequestError("the server is shutting down", status=503, kind="server_error")
        self._jobs.put(job)

    def close(self) -> None:
        """Cancels what is queued or running, stops the worker and finishes the cache's disk writes."""
        if self._thread is not None:
            self._closing = True
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
        if self.cache is not None:
            self.cache.close()

    def token_bytes(self, token: int) -> bytes:
        return self.model.tokenizer.token_bytes(token)

    def token_text(self, token: int) -> str:
        """A token as logprobs name it: its text, with the bytes of a partial UTF-8 character escaped (`\\xe2`), so
        that tokens holding different parts of characters stay distinct (their `bytes` are the real ones)."""
        if token not in self._token_text:
            self._token_text[token] = self.token_bytes(token).decode("utf-8", "backslashreplace")
        return self._token_text[token]

    # -- worker ----------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._closing or job.cancelled.is_set():
                self._cancelled(job)
                continue
            self.running = True
            error = None
            try:
                self._serve(job)
            except RequestError as e:
                error = e
            except Exception as e:  # a bug or a backend failure: answer 500 and keep serving
                log.exception("request failed")
                error = RequestError(f"internal error: {e}", status=500, kind="server_error")
            self._settle()
            self.running = False
            if error is not None:
                job.emit("error", error)

    def _cancelled(self, job: Job) -> None:
        with self.metrics.lock:
            self.metrics.cancelled += 1
        if self._closing:
            job.emit("error", RequestError("the server is shutting down", status=503, kind="server_error"))
        else:  # the client went away: nobody reads this
            job.emit("error", RequestError("cancelled", status=499))

    def check_prompt_length(self, n: int, param: str, *, at_least: bool = False) -> None:
        """Refuses a prompt of `n` tokens (or more, `at_least`) that leaves no room to generate."""
        if n >= self.max_context:
            raise RequestError(f"This model's maximum context length is {self.max_context} tokens, and the prompt "
                               f"has {'at least ' if at_least else ''}{n} tokens (at least one must be left to "
                               "generate).", param=param, code="context_length_exceeded")

    def check_prompt_text(self, text: str, param: str) -> None:
        """Refuses a prompt text that surely has too many tokens, without tokenising it (Tokenizer.min_tokens: a
        linear-time lower bound). Thread-safe."""
        if len(text) >= self.max_context:  # shorter texts are checked exactly once tokenised
            self.check_prompt_length(self.model.tokenizer.min_tokens(text), param, at_least=True)

    def tokenize(self, text: str, param: str) -> list[int]:
        """The ids of a prompt text, refused if there is no room to generate after them. Run off the event loop and
        off the worker (a request's handler thread: a long text tokenises with the GIL released), so that no
        prompt, however long, holds up other requests before it is refused. Thread-safe."""
        self.check_prompt_text(text, param)
        ids = self.model.tokenizer.encode(text)
        self.check_prompt_length(len(ids), param)
        return ids

    def _serve(self, job: Job) -> None:
        try:
            self.model.check_files()  # a weights file overwritten under the model: refuse, do not crash
        except CheckpointChangedError as e:
            raise RequestError(str(e), status=503, kind="server_error") from e
        prompt = job.prompt_fn(self.model)
        n = len(prompt.ids)
        if n == 0:
            raise RequestError("the prompt is empty", param=job.prompt_param)
        self.check_prompt_length(n, job.prompt_param)
        params = job.sampling.build(self.model, self.max_context - n)
        job.emit("accepted", prompt)
        t0 = time.perf_counter()
        cached = self._prepare(prompt.ids, params.max_tokens)
        t_first = t_end = None
        last: GenerationResponse | None = None
        generated = []
        stream = self.generate_fn(self.model, prompt.ids, session=self.session, sampling=params,
                                  progress=self._watch(job))
        try:
            for r in stream:
                t_end = time.perf_counter()
                t_first = t_first or t_end
                if self._closing or job.cancelled.is_set():
                    break
                last = r
                if r.token >= 0:
                    generated.append(r.token)
                job.emit("token", r)
        except _Cancelled:  # during the generation's prefill
            pass
        finally:
            stream.close()
            self._keep_saved()
        if last is None or last.finish_reason is None:
            self._cancelled(job)
            return
        held, eos = self.session.tokens, self.model.eos_token_ids
        end = reply_end(generated[-1] if generated else None, eos, self._turn_end[0],
                        last.finish_reason == "stop" and not (generated and generated[-1] in eos),
                        generated if params.ignore_eos else ())
        if end is not None and held[:n] == prompt.ids and held[n:] == generated[:len(held) - n] and \
                len(held) >= n + len(generated) - 1:
            job.held = Held(np.asarray(held, dtype=np.int32), generated[-1] if len(held) < n + len(generated) else None,
                            end)
        usage = Usage(n, cached, last.generation_tokens, last.finish_reason)
        self._record(usage, t_first - t0, t_end - t_first)  # before the response ends: a scrape after it sees it
        job.emit("done", usage)
        self._remember()  # the state after the reply: the next turn may extend it

    def _first_turn_end(self, ids: list[int]) -> int:
        """The position just after the first `<|im_end|>\\n` in `ids` (where a chat's opening turn ends), or len(ids)
        if there is none. Looks no further than that turn."""
        im_end, nl = self._turn_end
        start = 0
        while im_end is not None:
            try:
                at = ids.index(im_end, start)
            except ValueError:
                break
            if nl is None:
                return at + 1
            if at + 1 < len(ids) and ids[at + 1] == nl:
                return at + 2
            start = at + 1
        return len(ids)

    def _last_turn_start(self, ids: list[int]) -> int:
        """The position just after the last `<|im_start|>` in `ids` (the generation prompt's, in a chat prompt), or
        0 if there is none."""
        try:
            return len(ids) - ids[::-1].index(self._turn_start)
        except ValueError:
            return 0

    def _watch(self, job: Job) -> Callable[[int, int], None]:
        """A prefill progress callback that stops the prefill (_Cancelled) once the job is cancelled."""
        def check(done: int, total: int) -> None:
            if self._closing or job.cancelled.is_set():
                raise _Cancelled
        return check

    def _prepare(self, ids: list[int], max_tokens: int) -> int:
        """Brings the session to the longest saved prefix of `ids` (the live state or a cached snapshot). If that
        does not reach the end of the prompt's first turn (a new conversation: its system prompt and tools, which
        other conversations and agents' sub-sessions often share), asks for a snapshot there; else, just after the
        generation prompt's `<|im_start|>`, where the next turn's prompt, rendered whole, parts from this one's
        tokens when the template drops the reply's thinking (Conversation.keeps_thinking), so that it prefills only
        the reply as rendered and the new turn. The generation, which prefills the rest in one call, takes the
        snapshot on the way (_keep_saved caches it), so the prompt is one pass over the weights however it splits,
        as the engine's own. The KV caches are sized for the prompt and `max_tokens` first. Returns how many tokens
        came from saved state."""
        s, n = self.session, len(ids)
        held = s.tokens
        live = len(held) if 0 < len(held) < n and held == ids[:len(held)] else 0
        hit = self.cache.lookup(ids, longer_than=live) if self.cache is not None else None
        if hit is not None:
            s.restore(hit)
        elif live == 0:
            s.reset()
        cached = s.core.position
        s.reserve(n - cached + max_tokens)  # the KV caches once for the prompt and the reply, not per part
        opening, reply = self._first_turn_end(ids), self._last_turn_start(ids)
        if self.cache is not None:
            if cached < opening < n:
                s.core.save_at(opening)
            elif cached < reply < n:
                s.core.save_at(reply)
        return cached

    def _keep_saved(self) -> None:
        """Caches the snapshot the generation's prefill took on the way (_prepare), if it got that far."""
        saved = self.session.core.take_saved()
        if saved is not None and self.cache is not None:
            self.cache.insert(saved)

    def _remember(self) -> None:
        """Caches a snapshot of the session (keyed by the tokens it holds)."""
        if self.cache is not None and self.session.core.position:
            self.cache.insert(self.session.snapshot())

    def _settle(self) -> None:
        """After any request: a session whose tokens do not describe its state (a failure mid-step) starts over."""
        s = self.session
        if s.core.position != len(s.tokens):
            log.warning("session state and tokens disagree after a request; resetting the session")
            s.reset()

    def _record(self, usage: Usage, prefill_s: float, decode_s: float) -> None:
        m, prefilled = self.metrics, usage.prompt_tokens - usage.cached_tokens
        with m.lock:
            m.prompt_tokens += usage.prompt_tokens
            m.cached_tokens += usage.cached_tokens
            m.prefill_tokens += prefilled
            m.generation_tokens += usage.completion_tokens
            m.prefill_seconds += prefill_s
            m.decode_seconds += decode_s
            m.last_prefill_tps = prefilled / max(prefill_s, 1e-9)
            m.last_decode_tps = (usage.completion_tokens - 1) / decode_s if decode_s > 0 else 0.0
            if usage.cached_tokens:
                m.prefix_hits += 1
            else:
                m.prefix_misses += 1


def render_metrics(engine: Engine) -> str:
    """Prometheus text exposition of the engine's counters."""
    m, cache = engine.metrics, engine.cache
    lines = []

    def metric(name: str, kind: str, help_text: str, samples) -> None:
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"))
        for labels, value in samples:
            lines.append(f"{name}{labels} {value}")

    with m.lock:
        metric("lily_requests_total", "counter", "HTTP requests answered, by endpoint and status.",
               [(f'{{endpoint="{e}",status="{s}"}}', c) for (e, s), c in sorted(m.requests.items())])
        metric("lily_requests_cancelled_total", "counter", "Requests cancelled (client gone) before finishing.",
               [("", m.cancelled)])
        metric("lily_requests_running", "gauge", "Requests being generated now.", [("", int(engine.running))])
        metric("lily_requests_queued", "gauge", "Requests waiting for the engine.", [("", engine.queued)])
        metric("lily_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", [("", m.prompt_tokens)])
        metric("lily_prompt_cached_tokens_total", "counter", "Prompt tokens restored from saved state, not prefilled.",
               [("", m.cached_tokens)])
        metric("lily_prefill_tokens_total", "counter", "Prompt tokens prefilled.", [("", m.prefill_tokens)])
        metric("lily_prefill_seconds_total", "counter", "Time to first token, summed.", [("", m.prefill_seconds)])
        metric("lily_generation_tokens_total", "counter", "Tokens generated.", [("", m.generation_tokens)])
        metric("lily_decode_seconds_total", "counter", "Time from first to last token, summed.",
               [("", m.decode_seconds)])
        metric("lily_prefill_tokens_per_second", "gauge", "Prefill throughput of the last request.",
               [("", m.last_prefill_tps)])
        metric("lily_decode_tokens_per_second", "gauge", "Decode throughput of the last request.",
               [("", m.last_decode_tps)])
        metric("lily_prefix_cache_hits_total", "counter", "Prompts that started from saved state.",
               [("", m.prefix_hits)])
        metric("lily_prefix_cache_misses_total", "counter", "Prompts prefilled from the start.",
               [("", m.prefix_misses)])
    metric("lily_engine_tokens_processed_total", "counter", "Tokens the engine's session ran through the model "
           "(prefill and decode).", [("", engine.session.core.tokens_processed)])
    if cache is not None:
        metric("lily_prefix_cache_snapshots", "gauge", "Snapshots held in memory.", [("", cache.entries)])
        metric("lily_prefix_cache_bytes", "gauge", "Bytes of snapshots held in memory.", [("", cache.bytes)])
        metric("lily_prefix_cache_evictions_total", "counter", "Snapshots evicted from memory.",
               [("", cache.evictions)])
        metric("lily_prefix_cache_disk_snapshots", "gauge", "Snapshots on disk.", [("", cache.disk_entries)])
        metric("lily_prefix_cache_disk_bytes", "gauge", "Bytes of snapshots on disk.", [("", cache.disk_bytes)])
    return "\n".join(lines) + "\n"
