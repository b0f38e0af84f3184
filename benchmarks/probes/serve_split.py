"""Where a new conversation's time to the first token goes in the server's engine, without HTTP (full
Qwen3.6-35B-A3B geometry, random 4-bit weights): the engine's _prepare (reset, the opening turn fed without logits,
its snapshot into the prefix cache) and the generation of the first token over the rest of the prompt, against
lily.stream_generate of a prompt as long in a new session. The feed is timed with the snapshot that follows it (a
snapshot waits for the state); a second snapshot times the copy alone. Fresh text per prompt, four per length.

    python benchmarks/probes/serve_split.py [--backend cuda] [--lengths 4096,32768]
"""
import argparse
import sys
import threading
import time
from pathlib import Path

import lily
from lily.bench import load_for_bench
from lily.prefix_cache import PrefixCache, model_fingerprint
from lily.server.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_serve import message_of  # noqa: E402


class _Job:  # what Engine._prepare reads of a job
    cancelled = threading.Event()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--lengths", type=lambda s: [int(v) for v in s.split(",")], default=[4096, 32768])
    args = ap.parse_args()
    model = load_for_bench("random", args.backend)
    model.eos_token_ids = []
    engine = Engine(model, cache=PrefixCache(4 << 30, fingerprint=model_fingerprint(model)))
    s = engine.session
    first = dict(max_tokens=1, temperature=0)
    for L in [64] + [n for n in args.lengths for _ in range(4)]:
        ids = model.encode_prompt(message_of(model, L), enable_thinking=False)
        opening = engine._first_turn_end(ids)
        t0 = time.perf_counter()
        s.reset()
        s.reserve(len(ids) + 1)  # as the engine: the KV caches once for the prompt and the reply
        s.feed(ids[:opening])
        snap = s.snapshot()  # waits for the feed, then copies
        t1 = time.perf_counter()
        again = s.snapshot()  # the copy alone
        t2 = time.perf_counter()
        engine.cache.insert(snap)
        t3 = time.perf_counter()
        next(iter(lily.stream_generate(model, ids, session=s, **first)))
        t4 = time.perf_counter()
        ids2 = model.encode_prompt(message_of(model, L), enable_thinking=False)
        t5 = time.perf_counter()
        next(iter(lily.stream_generate(model, ids2, **first)))
        t6 = time.perf_counter()
        ms = lambda a, b: 1e3 * (b - a)  # noqa: E731
        print(f"L={len(ids)} (opening {opening}): feed + snapshot {ms(t0, t1):.1f} ms (a snapshot alone "
              f"{ms(t1, t2):.1f}), cache insert {ms(t2, t3):.1f}, the rest's first token {ms(t3, t4):.1f} "
              f"({len(ids) - opening} tokens): {ms(t0, t4):.1f} ms; library {ms(t5, t6):.1f} ms", flush=True)
        del snap, again


if __name__ == "__main__":
    main()
