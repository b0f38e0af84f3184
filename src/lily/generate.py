"""generate / stream_generate: prompt → tokens → prefill → decode loop → text, with the sampling settings,
stop conditions and statistics of mlx-lm's API."""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from lily import _core
from lily.conversation import Conversation, reply_end, turn_end_id
from lily.model import ContextLimitError, Model, Session, SessionConflictError, as_tokens
from lily.sampling import SamplingParams

FINISH = {0: None, 1: "stop", 2: "length"}


@dataclass
class GenerationResponse:
    text: str                        # new text since the previous response (may be empty)
    token: int                       # the token generated at this step (-1 when none)
    logprob: float                   # its log-probability under the model (raw logits)
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    prompt_tokens: int = 0           # tokens in the prompt
    cached_tokens: int = 0           # of those, already in the session's state (not prefilled again)
    prompt_tps: float = 0.0          # prefill speed over the new prompt tokens
    generation_tokens: int = 0       # tokens generated so far
    generation_tps: float = 0.0
    peak_memory: float = 0.0         # GB: the backend's peak allocation (state, buffers, resident weights)
    finish_reason: str | None = None  # None, "stop" (EOS or stop string) or "length"


def _sampling(model: Model, sampling: SamplingParams | None, overrides: dict) -> SamplingParams:
    if sampling is not None:
        if overrides:
            raise TypeError("pass sampling settings either as a SamplingParams or as keywords, not both")
        return sampling
    return SamplingParams.from_generation_config(model.generation_config, **overrides)


class _StopMatcher:
    """Holds back text that could be the start of a stop string; reports a stop when one is complete."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.keep = max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        self.buf += text
        if self.stops:
            cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                out, self.buf = self.buf[:cut], ""
                return out, True
        n = max(len(self.buf) - self.keep, 0) if self.stops else len(self.buf)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def stream_generate(model: Model, prompt, *, session: Session | None = None, sampling: SamplingParams | None = None,
                    tools: list[dict] | None = None, enable_thinking: bool | None = None,
                    chat_template_kwargs: dict | None = None, progress: Callable[[int, int], object] | None = None,
                    **sampling_kwargs) -> Iterator[GenerationResponse]:
    """Generates from `prompt` (text, token ids, or chat messages), yielding a response per token.

    Sampling keywords (temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty,
    frequency_penalty, seed, max_tokens, stop, top_logprobs, logit_bias, ignore_eos, min_tokens: lily.SamplingParams)
    default to the model's generation_config.json; max_tokens to its max_new_tokens, else 256. A logit_bias or a
    min_tokens keeps the token selection on the host.
    With a `session`, a prompt extending what the session already holds prefills only its new tokens.

    progress(done, total), if given, reports the prefill of the prompt's new tokens: (0, total) at its start,
    after each chunk of a long prompt, and (total, total) once the first token is out.

    Interrupts: Ctrl-C (KeyboardInterrupt) stops the prefill within one chunk, and the session keeps the prompt
    tokens read so far (a later prompt that extends them reuses them). Interrupted while generating, or closed
    early, a chat generation keeps the reply so far: `session.messages` ends with it, and a next call whose
    messages carry that reply continues the state without reading the conversation again."""
    params = _sampling(model, sampling, sampling_kwargs)
    template_kwargs = dict(chat_template_kwargs or {})
    if enable_thinking is not None:
        template_kwargs["enable_thinking"] = enable_thinking
    messages = list(prompt) if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict) else None
    session = session or model.session()
    if session.model is not model:
        raise ValueError("the session belongs to another model: make it with this model's session()")
    model.check_files()
    # Each block that changes the state and the session's record of it holds the session (Session.exclusive);
    # between steps the session is free, and a change made there by anyone else ends this generation
    # (SessionConflictError).
    with session.exclusive():
        ids = session.continuation(messages, tools, **template_kwargs) if messages else None
        if ids is None and (messages is not None or isinstance(prompt, str)):
            ids = model.encode_prompt(prompt, tools=tools, **template_kwargs)
        tokens = as_tokens(prompt if ids is None else ids, "prompt token ids")  # token ids are checked once
        prompt_ids = tokens.tolist()
        if not prompt_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        cached = session.reuse(prompt_ids)
        new = prompt_ids[cached:]
        try:
            session.core.check_room(len(new))
        except ValueError as e:
            raise ContextLimitError(str(e)) from None
        model.core.reset_peak_memory()

        bias_ids, bias_values = params.bias_arrays()
        eos = [] if params.ignore_eos else model.eos_token_ids
        gen = _core.Generator(session.core, params.to_core(), eos, params.max_tokens, model.n_valid,
                              bias_ids=bias_ids, bias_values=bias_values, min_tokens=params.min_tokens)
        t0 = time.perf_counter()
        session.conversation = None
        if progress is not None:
            progress(0, len(new))
        gen.prefill(tokens[cached:], progress=progress)  # interrupted: the session holds the chunks done
    prompt_tps = 0.0  # set at the first token: the device loop returns from prefill before the prefill is done

    detok = model.tokenizer.detokenizer()
    stop = _StopMatcher(params.stop)
    t1 = time.perf_counter()
    generated, reply = [], []
    by_stop_string = False

    def step() -> tuple[GenerationResponse, bool]:
        """One token; (response, last)."""
        nonlocal prompt_tps, by_stop_string
        token, logprob, top_ids, top_lps, finish = gen.next()
        if not prompt_tps:  # time to the first token
            prompt_tps = len(new) / max(time.perf_counter() - t0, 1e-9)
        stats = dict(prompt_tokens=len(prompt_ids), cached_tokens=cached, prompt_tps=prompt_tps,
                     peak_memory=model.core.peak_memory / 1e9)
        n = len(generated)
        if token < 0:  # the context is full: nothing more can be generated
            return GenerationResponse(stop.push(detok.flush())[0] + stop.flush(), -1, 0.0, generation_tokens=n,
                                      generation_tps=n / max(time.perf_counter() - t1, 1e-9),
                                      finish_reason="length", **stats), True
        generated.append(token)
        n += 1
        reason = FINISH[finish]
        text, hit = stop.push("" if reason == "stop" else detok.add(token))  # an EOS token adds no text
        if hit:
            reason, by_stop_string = "stop", True
        elif reason is not None:
            text += stop.push(detok.flush())[0] + stop.flush()
        reply.append(text)
        if reason is not None:
            remember(generated)
        return GenerationResponse(text, token, float(logprob), list(zip(top_ids, top_lps)), generation_tokens=n,
                                  generation_tps=n / max(time.perf_counter() - t1, 1e-9), finish_reason=reason,
                                  **stats), reason is not None

    def remember(returned: list[int]) -> None:
        """Records the conversation the state now holds, the reply so far last, for the next turn (none where the
        reply's end leaves the state another conversation than its text: conversation.reply_end)."""
        end = reply_end(returned[-1] if returned else None, model.eos_token_ids, turn_end_id(model.tokenizer),
                        by_stop_string, returned if params.ignore_eos else ())
        if messages is None or end is None:
            return
        held = session.tokens
        session.conversation = Conversation(
            tuple(messages + [{"role": "assistant", "content": "".join(reply)}]), tools, template_kwargs,
            np.asarray(held, dtype=np.int32), returned[-1] if len(held) < len(prompt_ids) + len(returned) else None,
            end)

    epoch = session.core.epoch  # the state as this generation's last step left it
    first, last, recorded = True, False, False
    while True:
        try:
            with session.exclusive():
                try:
                    response, last = step()
                except KeyboardInterrupt:  # maybe between gen.next() and the bookkeeping: the core knows
                    remember(gen.tokens)
                    recorded = True
                    raise
                epoch = session.core.epoch
            if first and progress is not None:  # the prefill is complete once the first step is
                progress(len(new), len(new))
            first = False
            yield response
        except (GeneratorExit, KeyboardInterrupt):  # closed early (the consumer stopped, e.g. at Ctrl-C), or
            # interrupted between steps: keep the reply so far, unless something else used the session since
            if not (recorded or last) and session.core.epoch == epoch:
                with contextlib.suppress(SessionConflictError), session.exclusive():
                    remember(generated)
            raise
        if last:
            return


def generate(model: Model, prompt, *, verbose: bool = False, **kwargs) -> str:
    """The whole generated text (see stream_generate for the arguments). verbose prints it as it comes,
    then the backend and the speeds."""
    text, last = [], None
    for r in stream_generate(model, prompt, **kwargs):
        text.append(r.text)
        if verbose:
            print(r.text, end="", flush=True)
        last = r
    if verbose and last is not None:
        print(file=sys.stderr)
        print(f"Backend: {model.backend} ({model.device})\n"
              f"Prompt: {last.prompt_tokens} tokens ({last.cached_tokens} cached), {last.prompt_tps:.1f} tok/s\n"
              f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s\n"
              f"Peak memory: {last.peak_memory:.3f} GB", file=sys.stderr)
    return "".join(text)
