"""Agent turns through the server. A conversation of --context tokens grows one turn of about --turn tokens at a
time, as an agent loop's does; each turn is sent with the official openai client (streamed) to the app `lily serve`
runs (its Engine and prefix cache, served by uvicorn in this process, over loopback HTTP). Its time to the first
streamed token is set against the engine's own time for the same new tokens: a fresh session holding the same
prefix, lily.stream_generate, time to the first token. The difference is what serving costs per turn (request
parsing, rendering the new turn, restoring and snapshotting state, HTTP); issue 12 bounds it at 15 ms.

    python benchmarks/bench_agent.py --model random --backend cuda --out benchmarks/results/h200_agent.json
    python benchmarks/bench_agent.py --model tiny --context 2000 --turn 200    # any machine, a smoke run
"""
from __future__ import annotations

import argparse
import json
import platform
import secrets
import time
from pathlib import Path

import openai

import lily
from lily.bench import load_for_bench
from lily.prefix_cache import PrefixCache, model_fingerprint
from lily.server import BackgroundServer, Engine

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu").split()
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def text_of(model: lily.Model, tokens: int) -> str:
    """Fresh random words of about `tokens` tokens."""
    words: list[str] = []
    while len(model.tokenizer.encode(" ".join(words))) < tokens:
        words += [secrets.choice(WORDS) for _ in range(max(8, (tokens - len(words)) // 4))]
    return " ".join(words)


def start_server(model: lily.Model) -> BackgroundServer:
    """The app `lily serve` runs (lily.server.serve: an Engine with the default prefix cache) on a free port."""
    engine = Engine(model, cache=PrefixCache(4 << 30, fingerprint=model_fingerprint(model)))
    return BackgroundServer(engine, model_id="lily")


def streamed_turn(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """(seconds to the first streamed token, the reply, usage) of one streamed chat completion. Each token comes
    with its logprob, so that a token with no text (random weights pick ids the tokenizer has no text for) still
    shows when it arrives."""
    t0 = time.perf_counter()
    first, parts, usage = None, [], None
    stream = client.chat.completions.create(model="lily", messages=messages, max_tokens=max_tokens, temperature=0,
                                            logprobs=True, stream=True, stream_options={"include_usage": True},
                                            extra_body=NO_THINKING)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            if choice.delta.content or choice.logprobs is not None:
                first = first or time.perf_counter() - t0
                parts.append(choice.delta.content or "")
    return first, "".join(parts), usage


def held_tokens(engine: Engine) -> list[int]:
    """The tokens the engine's session holds, once its worker is done with it (it snapshots after the reply)."""
    while True:
        try:
            return engine.session.tokens
        except lily.SessionConflictError:
            time.sleep(0.001)


def engine_ttft(session: lily.Session, prompt: list[int], cached: int) -> float:
    """Seconds from `session` holding prompt[:cached] to the first token of lily.stream_generate(prompt). The session
    lives from turn to turn, as the server's does (its buffers already sized): it is brought to prompt[:cached] from
    what it holds, untimed."""
    held = session.tokens
    if len(held) > cached or held != prompt[:len(held)]:
        session.reset()
        held = []
    if cached > len(held):
        session.prefill(prompt[len(held):cached])  # its logits come back once it is done: the clock starts after
    t0 = time.perf_counter()
    next(iter(lily.stream_generate(session.model, prompt, session=session, max_tokens=1, temperature=0)))
    return time.perf_counter() - t0


def run(args) -> dict:
    model = load_for_bench(args.model, args.backend)
    model.eos_token_ids = []  # every reply runs to max_tokens, whatever the random weights say
    server = start_server(model)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        warm = [{"role": "user", "content": text_of(model, 64)}]  # compiles and records what the first call does
        warm += [{"role": "assistant", "content": streamed_turn(client, warm, args.max_tokens)[1]},
                 {"role": "user", "content": text_of(model, 64)}]
        streamed_turn(client, warm, args.max_tokens)

        reference = model.session()
        engine_ttft(reference, warm_prompt := model.encode_prompt(warm), len(warm_prompt) // 2)  # sizes its buffers

        messages = [{"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": text_of(model, args.context)}]
        ttft, reply, usage = streamed_turn(client, messages, args.max_tokens)
        print(f"first turn: {usage['prompt_tokens']} prompt tokens, {ttft * 1e3:.1f} ms to the first token")
        turns = []
        for i in range(args.turns):
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": text_of(model, args.turn)}]
            ttft, reply, usage = streamed_turn(client, messages, args.max_tokens)
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            prompt = held_tokens(server.engine)[:usage["prompt_tokens"]]  # the state holds the prompt first
            ref = engine_ttft(reference, prompt, cached)
            turn = {"prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached,
                    "new_tokens": usage["prompt_tokens"] - cached, "server_ttft_ms": ttft * 1e3,
                    "engine_ttft_ms": ref * 1e3, "overhead_ms": (ttft - ref) * 1e3}
            turns.append(turn)
            print(f"turn {i + 1}: {turn['new_tokens']} new of {turn['prompt_tokens']} tokens: server "
                  f"{turn['server_ttft_ms']:.1f} ms, engine {turn['engine_ttft_ms']:.1f} ms, overhead "
                  f"{turn['overhead_ms']:.1f} ms")
    finally:
        server.close()
    overheads = sorted(t["overhead_ms"] for t in turns)
    return {"what": "agent turns through the server (openai client, streamed) against the engine's own prefill of "
                    "the same new tokens", "model": args.model, "backend": model.backend, "device": model.device,
            "machine": platform.node(), "context": args.context, "turn": args.turn, "max_tokens": args.max_tokens,
            "turns": turns, "median_overhead_ms": overheads[len(overheads) // 2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random", help="'random' (the full geometry, random weights), 'tiny' or a path")
    p.add_argument("--backend", default=None)
    p.add_argument("--context", type=int, default=10000, help="tokens of the conversation before the first turn")
    p.add_argument("--turn", type=int, default=600, help="tokens each turn adds")
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens of each reply")
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args()
    result = run(args)
    print(f"median overhead per turn: {result['median_overhead_ms']:.1f} ms")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
