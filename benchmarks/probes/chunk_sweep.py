"""Which default prefill chunk: a kept session's prefill of an L-token prompt (full geometry, random 4-bit weights)
with each chunk size, the median of three after one untimed run, and the backend's peak memory.

    python benchmarks/probes/chunk_sweep.py [--backend cuda] [--lengths 32768,131072] [--chunks 4096,8192]
"""
import argparse
import time

import numpy as np

import lily
from lily.bench import FULL_TEXT_CONFIG
from lily.tiny import build_random


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--chunks", default="4096,8192")
    args = ap.parse_args()
    model = lily.Model(build_random(FULL_TEXT_CONFIG, seed=0), args.backend)
    rng = np.random.default_rng(0)
    for L in (int(v) for v in args.lengths.split(",")):
        prompt = rng.integers(0, model.n_valid, L).astype(np.int32)
        for chunk in (int(v) for v in args.chunks.split(",")):
            session = model.core.session(max_context=L + 64, prefill_chunk=chunk)
            model.core.reset_peak_memory()
            times = []
            for i in range(3 if L > 65536 else 4):
                session.reset()
                t0 = time.perf_counter()
                session.prefill(prompt)  # the last logits come back to the host: the prefill is complete
                times.append(time.perf_counter() - t0)
            t = float(np.median(times[1:]))
            print(f"L={L} chunk={chunk}: {1e3 * t:.1f} ms, {L / t:,.0f} tok/s, peak "
                  f"{model.core.peak_memory / 1e9:.2f} GB (runs, ms: {[round(1e3 * v, 1) for v in times]})", flush=True)
            del session


if __name__ == "__main__":
    main()
