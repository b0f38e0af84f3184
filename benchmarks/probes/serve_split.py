"""Where a new conversation's time to the first token goes in the server's engine, without HTTP (full
Qwen3.6-35B-A3B geometry, random 4-bit weights): the engine's way (reset, the KV caches reserved, the opening turn's
snapshot asked for with Session.save_at, the first token of a generation over the whole prompt, which takes that
snapshot on the way, then its insertion into the prefix cache) against lily.stream_generate of a prompt as long in a
new session. Fresh text per prompt, four per length.

    python benchmarks/probes/serve_split.py [--backend cuda] [--lengths 4096,32768]
"""
import argparse
import sys
import time
from pathlib import Path

import lily
from lily.bench import load_for_bench
from lily.prefix_cache import PrefixCache, model_fingerprint
from lily.server.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_serve import message_of  # noqa: E402


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
        s.core.save_at(opening)
        next(iter(lily.stream_generate(model, ids, session=s, **first)))
        t1 = time.perf_counter()
        saved = s.core.take_saved()
        engine.cache.insert(saved)
        t2 = time.perf_counter()
        ids2 = model.encode_prompt(message_of(model, L), enable_thinking=False)
        t3 = time.perf_counter()
        next(iter(lily.stream_generate(model, ids2, **first)))
        t4 = time.perf_counter()
        ms = lambda a, b: 1e3 * (b - a)  # noqa: E731
        print(f"L={len(ids)} (opening {opening}, snapshot taken: {saved is not None}): first token {ms(t0, t1):.1f} ms,"
              f" cache insert {ms(t1, t2):.1f}; library {ms(t3, t4):.1f} ms", flush=True)
        del saved


if __name__ == "__main__":
    main()
