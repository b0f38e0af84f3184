"""Op benchmark over the op test's case table (tests/ops/cases.py): µs per launch, GB/s and TFLOP/s against the
case's own byte and FLOP counts.

    python benchmarks/bench_ops.py --backend cuda [-o qmm,moe] [--tags model] [--disable attn_wgmma] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lily import _core  # noqa: E402
from ops.cases import CASES, make  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cuda")
    p.add_argument("-o", "--ops", default="", help="comma-separated op names (default: all)")
    p.add_argument("--tags", default="model", help="only cases with this tag ('' for all)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--disable", default="", help="comma-separated optimisation switches to turn off")
    p.add_argument("--json", default="")
    args = p.parse_args()
    ops = set(filter(None, args.ops.split(",")))
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'case':<52} {'µs':>10} {'GB/s':>8} {'TFLOP/s':>8}")
    for case in CASES:
        if (ops and case.op not in ops) or (args.tags and args.tags not in case.tags):
            continue
        params, inputs = make(case, rng)
        params = {**params, "disable": args.disable}
        us = _core.testing.time_op(args.backend, case.op, params, inputs, args.iters)
        gbs, tfs = case.bytes() / us / 1e3, case.flops() / us / 1e6
        rows.append({"case": case.id, "us": us, "gb_s": gbs, "tflop_s": tfs})
        print(f"{case.id:<52} {us:>10.1f} {gbs:>8.0f} {tfs:>8.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"backend": args.backend, "disable": args.disable, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
