"""One switch's worth on decode, finer than `lily bench --ablate` (one generation per point): two models from one
checkpoint (full geometry, random 4-bit weights), the switch off in one, generations through the default path
(`lily.bench.measure`: lily.stream_generate, the model's sampling, the device loop) alternating between them (ABBA
order), the median decode rate of each at each context length. `--off` names a set of switches turned off in both.
A SWITCH argument may join several with "+": they go off together in the "off" model. Each argument builds its own
pair of models, so naming one twice measures a second pair (two instances of one build differ by up to ~1 % on an
H100: a prefill-only switch, an A/A pair, measured −0.85 … +0.39 % at 4K). Both models share one build, so "off" is
the new build's off position: before a merge, ab_builds.py checks the build against the one without the change.

    python benchmarks/probes/ab_decode.py SWITCH[+SWITCH ...] [...] [--backend cuda] [--lengths 4096,32768] [--runs 6]
"""
import argparse

import numpy as np

import lily
from lily.bench import FULL_TEXT_CONFIG, measure, random_model
from lily.tiny import build_random


def main() -> None:
    names = [n for n, _, _ in lily.optimisations()]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("switches", nargs="+", help="switch names, or several joined by '+'")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--tokens", type=int, default=192, help="decoded tokens per generation")
    ap.add_argument("--runs", type=int, default=6, help="generations per model and length")
    ap.add_argument("--off", default="", help="switches off in both models (comma-separated)")
    args = ap.parse_args()
    base = [n for n in args.off.split(",") if n]
    for n in [n for arg in args.switches for n in arg.split("+")] + base:
        if n not in names:
            ap.error(f"unknown switch {n!r} (lily.optimisations() names: {', '.join(names)})")
    ckpt = build_random(FULL_TEXT_CONFIG, seed=0)
    rng = np.random.default_rng(0)
    for switch in args.switches:
        models = {"on": random_model(args.backend, base, ckpt),
                  "off": random_model(args.backend, base + switch.split("+"), ckpt)}
        for m in models.values():
            m.eos_token_ids = []  # every generation runs its token count
            measure(m, 256, 8, rng)  # warm-up: kernels loaded, scratch grown
        for L in (int(x) for x in args.lengths.split(",")):
            rates = {"on": [], "off": []}
            for i in range(args.runs):
                for k in ("on", "off") if i % 2 == 0 else ("off", "on"):
                    rates[k].append(measure(models[k], L, args.tokens, rng)["decode_tok_s"])
            on, off = (float(np.median(rates[k])) for k in ("on", "off"))
            print(f"{switch} @ {L}: on {on:.1f} tok/s, off {off:.1f}: {100 * (on / off - 1):+.2f} % from the switch "
                  f"(on {[round(r, 1) for r in rates['on']]}, off {[round(r, 1) for r in rates['off']]})", flush=True)
        del models


if __name__ == "__main__":
    main()
