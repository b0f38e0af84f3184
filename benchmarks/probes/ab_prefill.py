"""One switch's worth on the steady-state prefill of a 4K prompt, finer than `lily bench --ablate` (one generation
per point): two models from one checkpoint (full geometry, random 4-bit weights), the switch on in one and off in the
other, a kept session each, six prefills alternating between them (ABBA order), the medians of the last five.

    python benchmarks/probes/ab_prefill.py SWITCH [SWITCH ...] [--backend cuda] [--tokens 4096]
"""
import argparse
import time

import numpy as np

import lily
from lily.bench import FULL_TEXT_CONFIG
from lily.tiny import build_random


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("switches", nargs="+", choices=[n for n, _, _ in lily.optimisations()])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    ckpt = build_random(FULL_TEXT_CONFIG, seed=0)
    for switch in args.switches:
        models = {"on": lily.Model(ckpt, args.backend), "off": lily.Model(ckpt, args.backend, [switch])}
        prompt = np.random.default_rng(0).integers(0, models["on"].n_valid, args.tokens).astype(np.int32)
        sessions = {k: m.core.session(max_context=args.tokens + 64, prefill_chunk=0) for k, m in models.items()}
        times = {"on": [], "off": []}
        for i in range(6):
            for k in ("on", "off") if i % 2 == 0 else ("off", "on"):
                sessions[k].reset()
                t0 = time.perf_counter()
                sessions[k].prefill(prompt)  # the last logits come back to the host: the prefill is complete
                times[k].append(time.perf_counter() - t0)
        on, off = (float(np.median(times[k][1:])) for k in ("on", "off"))
        print(f"{switch}: on {1e3 * on:.2f} ms, off {1e3 * off:.2f} ms: {100 * (off / on - 1):+.2f} % from the switch "
              f"(each run, ms: on {[round(1e3 * t, 2) for t in times['on']]}, off "
              f"{[round(1e3 * t, 2) for t in times['off']]})", flush=True)
        del models, sessions


if __name__ == "__main__":
    main()
