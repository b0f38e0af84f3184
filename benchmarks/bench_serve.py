"""A new conversation's time to the first token through the server against the library (issue 10: within 10 % at 4K
and 32K). Each point sends one user message of about L tokens of fresh text (no cached prefix) with the official
openai client, streamed, to the app `lily serve` runs (its Engine and default prefix cache, served by uvicorn in this
process, over loopback HTTP), and gives another fresh message of the same length to lily.stream_generate on the
library's default path (a new session per call); both render the same chat template and tokenize. Medians of
--repeats, after one untimed request each way.

    python benchmarks/bench_serve.py --model random --backend cuda --out benchmarks/results/h200_serve.json
    python benchmarks/bench_serve.py --model tiny --lengths 512,2048    # any machine, a smoke run
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import openai

import lily
from bench_agent import NO_THINKING, start_server, streamed_turn, text_of
from lily.bench import load_for_bench


def message_of(model: lily.Model, tokens: int) -> list[dict]:
    """A conversation of one user message of fresh words whose rendered prompt is about `tokens` tokens."""
    ids = model.tokenizer.encode(text_of(model, tokens))
    overhead = len(model.encode_prompt([{"role": "user", "content": ""}], enable_thinking=False))
    return [{"role": "user", "content": model.tokenizer.decode(ids[:max(1, tokens - overhead)])}]


def library_ttft(model: lily.Model, messages: list[dict]) -> float:
    t0 = time.perf_counter()
    next(iter(lily.stream_generate(model, messages, max_tokens=1, temperature=0,
                                   **NO_THINKING["chat_template_kwargs"])))
    return time.perf_counter() - t0


def run(args) -> dict:
    model = load_for_bench(args.model, args.backend)
    model.eos_token_ids = []
    server = start_server(model)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    points = []
    try:
        warm = message_of(model, 64)
        streamed_turn(client, warm, 1)
        library_ttft(model, warm)
        for length in args.lengths:
            served, library, tokens = [], [], 0
            for _ in range(args.repeats):
                ttft, _, usage = streamed_turn(client, message_of(model, length), 1)
                served.append(ttft)
                tokens = usage["prompt_tokens"]
                library.append(library_ttft(model, message_of(model, length)))
            s, lib = sorted(served)[len(served) // 2], sorted(library)[len(library) // 2]
            point = {"length": length, "prompt_tokens": tokens, "server_ttft_ms": s * 1e3, "library_ttft_ms": lib * 1e3,
                     "overhead_pct": 100 * (s / lib - 1), "server_prefill_tok_s": tokens / s,
                     "library_prefill_tok_s": tokens / lib}
            points.append(point)
            print(f"L={length:>6} ({tokens} prompt tokens): server {point['server_ttft_ms']:.1f} ms, library "
                  f"{point['library_ttft_ms']:.1f} ms: {point['overhead_pct']:+.1f} % "
                  f"({point['server_prefill_tok_s']:.0f} vs {point['library_prefill_tok_s']:.0f} tok/s)", flush=True)
    finally:
        server.close()
    return {"what": "a new conversation's time to the first token: lily serve's app + the openai client (streamed) "
                    "against lily.stream_generate, medians", "model": args.model, "backend": model.backend,
            "device": model.device, "machine": platform.node(), "repeats": args.repeats, "points": points}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random", help="'random' (the full geometry, random weights), 'tiny' or a path")
    p.add_argument("--backend", default=None)
    p.add_argument("--lengths", type=lambda s: [int(v) for v in s.split(",")], default=[4096, 32768])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = p.parse_args()
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
