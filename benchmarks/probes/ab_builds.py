"""Decode A/B between two builds of Lily on one machine: the build before a change against the build after it, which
is what a user gets. ab_decode.py compares a switch's two positions inside one build, so the "off" it measures is
the new build's; a change can win that comparison and still lose to the build without it (session 41: route_sorted
measured +2.6 % against its own off position and -3.3 % against the previous main). Each build is a directory put
first on PYTHONPATH (`pip install --no-deps --target DIR WHEEL`); each leg is `lily bench --model random` (the default
path, sampled and greedy) in its own process, the legs alternating ABBA; the medians of the legs per length.

    python benchmarks/probes/ab_builds.py OLD_DIR NEW_DIR [--backend cuda] [--lengths 4096,32768] [--rounds 1]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[1] / "bench_model.py"


def leg(site: str, args: argparse.Namespace, out: Path) -> dict:
    """One `lily bench` run of the build in site: {length: (sampled, greedy) decode tok/s}."""
    path = [site] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, str(BENCH), "--backend", args.backend, "--lengths", args.lengths, "--greedy", "--out",
           str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"ab_builds: {site}: lily bench failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    res = json.loads(out.read_text())["results"]
    return {r["length"]: (r["decode_tok_s"], r["decode_greedy_tok_s"]) for r in res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old", help="the build before the change (a directory for PYTHONPATH)")
    ap.add_argument("new", help="the build after it")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--rounds", type=int, default=1, help="ABBA rounds (two legs of each build a round)")
    args = ap.parse_args()
    for site in (args.old, args.new):
        if not (Path(site) / "lily").is_dir():
            ap.error(f"{site}: no lily package in it (install a wheel with pip install --target {site})")
    legs = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(2 * args.rounds):
            for k in ("old", "new") if i % 2 == 0 else ("new", "old"):
                legs[k].append(leg(getattr(args, k), args, Path(tmp) / f"{k}{i}.json"))
                print(f"{k}: " + ", ".join(f"{L} {s:.1f} / greedy {g:.1f}" for L, (s, g) in legs[k][-1].items()),
                      flush=True)
    for L in legs["old"][0]:
        for j, mode in enumerate(("sampled", "greedy")):
            old, new = ([run[L][j] for run in legs[k]] for k in ("old", "new"))
            mo, mn = float(np.median(old)), float(np.median(new))
            print(f"@ {L} {mode}: old {mo:.1f} tok/s, new {mn:.1f}: {100 * (mn / mo - 1):+.2f} % "
                  f"(old {[round(r, 1) for r in old]}, new {[round(r, 1) for r in new]})", flush=True)


if __name__ == "__main__":
    main()
