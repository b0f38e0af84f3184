"""Where the default path's time to the first token goes (full Qwen3.6-35B-A3B geometry, random 4-bit weights):
creating the session, creating the Generator, the prefill call (which returns once the chunks are enqueued), the
wait for the first token; and, for comparison, a kept session's prefill of the same prompt with its last logits read
back (Session.prefill, buffers already sized). Three 4K prompts (the first pays the process's first-use costs), then
one of 32K.

    python benchmarks/probes/ttft_split.py [--backend cuda]
"""
import argparse
import time

import numpy as np

import lily
from lily import _core
from lily.bench import FULL_TEXT_CONFIG
from lily.tiny import build_random


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    args = ap.parse_args()
    model = lily.Model(build_random(FULL_TEXT_CONFIG, seed=0), args.backend)
    rng = np.random.default_rng(0)
    for L in (4096, 4096, 4096, 32768):
        prompt = rng.integers(0, model.n_valid, L).astype(np.int32)
        t0 = time.perf_counter()
        session = model.session()
        t1 = time.perf_counter()
        gen = _core.Generator(session.core, lily.SamplingParams().to_core(), model.eos_token_ids, 8, model.n_valid)
        t2 = time.perf_counter()
        gen.prefill(prompt)
        t3 = time.perf_counter()
        gen.next()
        t4 = time.perf_counter()
        kept = model.core.session(max_context=L + 64, prefill_chunk=0)
        kept.prefill(prompt)  # sizes its buffers
        kept.reset()
        t5 = time.perf_counter()
        kept.prefill(prompt)
        t6 = time.perf_counter()
        print(f"L={L}: session {1e3 * (t1 - t0):.2f} ms, Generator {1e3 * (t2 - t1):.2f}, prefill call "
              f"{1e3 * (t3 - t2):.2f}, first token {1e3 * (t4 - t3):.2f}: TTFT {1e3 * (t4 - t0):.2f} ms "
              f"({L / (t4 - t0):.0f} tok/s); kept session's prefill {1e3 * (t6 - t5):.2f} ms "
              f"({L / (t6 - t5):.0f} tok/s)", flush=True)
        del gen, session, kept


if __name__ == "__main__":
    main()
