"""Where the replayed decode step's time goes, kernel by kernel, with the overlap the graph and PDL allow. Needs a
build with the probe compiled in (CMake option LILY_STEP_TRACE, never shipped):

    pip install --no-build-isolation --no-deps -C cmake.define.LILY_STEP_TRACE=ON .
    python benchmarks/probes/step_trace.py [--context 4096] [--steps 64] [--out trace.json]

Every kernel's block 0 records when it passes its PDL wait (csrc/backend/cuda/step_trace.h): the moment its
predecessor's results became visible to it. The time from one kernel's record to the next one's is the first
kernel's share of the step's critical path (what the step would lose if it took no time), the sum over a step is the
step. ncu times graph nodes one at a time without that overlap (`profile_step.py`: an upper bound); nsys does not run
on the lent machines. Every block also records reaching its pdl_trigger, its first instructions: "lead" is the median
over a launch's blocks of how long a block sat on its SM before block 0's wait returned (the time PDL gave its early
loads; negative for blocks that found room only later), "early" the share of blocks in before the wait by ≥ 0.5 µs,
"last" how long after the wait its latest block arrived (negative: every block was in before it).
Kernels may also mark phases of their own (LILY_TRACE_PHASE and TracePhases in common.cuh; the cluster sampler and
the MoE decode kernels do): each phase's time after its launch's wait is printed, the median over the launch's blocks,
the 90th percentile and its latest block, with the time from the latest to the next kernel's wait.
`--sampled` selects with the model's default sampling instead of greedy.

A probe that moves the step: the trace build's step runs ~9 % slower than the shipped one (H100 at 4K: 1,606 µs
greedy and 1,651 sampled against ~1,470 and ~1,495; benchmarks/NOTES.md sessions 54 and 55). The weight is the trace
build's code, not its records: a mode that recorded block 0's waits alone (~330 records a step instead of ~150,000)
ran 1,632 µs, and was removed. Three times the trace promised more than the shipped step gave (the picks' oracle
2.4 % against nil, `moe_down_early` 3.1 % against 1.1 to 1.4 %, `moe_down_stage` 2.1 % against −0.2 %). It says where
to look; `ab_decode.py` and `ab_builds.py` on a shipped build decide.
"""
from __future__ import annotations

import argparse
import bisect
import json
import re
import shutil
import subprocess
from collections import defaultdict

import numpy as np


def demangle(names: list[str]) -> list[str]:
    if shutil.which("c++filt"):
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
        names = out[: len(names)]
    # void lily::cuda::(anonymous namespace)::moe_gate_up_kernel<4>(…) → moe_gate_up_kernel<4>
    names = [re.sub(r"\(.*$", "", n.replace("(anonymous namespace)::", "")) for n in names]
    return [re.sub(r"^(\w+::)+", "", n.removeprefix("void ")) for n in names]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=64, help="replayed steps recorded")
    ap.add_argument("--disable", default="", help="switches off (comma-separated)")
    ap.add_argument("--out", default="")
    ap.add_argument("--sampled", action="store_true", help="the model's default sampling instead of greedy")
    args = ap.parse_args()

    import lily
    from lily import _core
    from lily.bench import random_model

    if not hasattr(_core.testing, "step_trace_start"):
        raise SystemExit("this build has no step trace: build with -C cmake.define.LILY_STEP_TRACE=ON")
    off = [n for n in args.disable.split(",") if n]
    model = random_model("cuda", off)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.n_valid, args.context).astype(np.int32)
    s = model.core.session(max_context=args.context + args.steps + 64)
    sampling = (lily.SamplingParams.from_generation_config(model.generation_config) if args.sampled
                else lily.SamplingParams(temperature=0.0))
    g = _core.Generator(s, sampling.to_core(), [], args.steps + 16, model.n_valid)
    g.prefill(prompt)
    # every block's start and the MoE phases: ~150K records a step
    _core.testing.step_trace_start((args.steps + 8) * 400_000)
    for _ in range(args.steps + 4):  # an eager step, the captured one, then replays
        g.next()
    names, grids, times = _core.testing.step_trace_stop()

    # One time per launch, its block 0's first wait. A graph's node keeps its %gridid from replay to replay, so a
    # launch is a run of records of one id in time order (the next kernel cannot pass its wait before this one ends).
    # Start records (top bit of the id) are each block reaching its pdl_trigger: kept apart, per id, in time order.
    order, starts, phases = [], defaultdict(list), defaultdict(lambda: defaultdict(list))
    for t, gid in sorted(zip(times, grids)):
        if (gid >> 62) & 1:  # a phase inside a kernel (LILY_TRACE_PHASE, TracePhases): bits 56-61, per launch id
            phases[gid & ((1 << 56) - 1)][(gid >> 56) & 63].append(t)
        elif gid >> 63:
            starts[gid & ~(1 << 63)].append(t)
        elif not order or order[-1][0] != gid:
            order.append((gid, t))
    K = len(names)
    R = min(args.steps, len(order) // K - 1)
    if K == 0 or R < 1:
        raise SystemExit(f"{len(order)} records for {K} kernels per step: nothing to read")
    t = np.array([v for _, v in order[-(R + 1) * K:]], dtype=np.float64).reshape(R + 1, K)
    # Each launch's block starts: those of its id within 200 µs of its wait (a step is > 1 ms, so this replay's).
    def near(ts: list, tw: float) -> np.ndarray:  # the records of ts (in time order) of this replay's launch
        return np.array(ts[bisect.bisect_left(ts, tw - 200_000):bisect.bisect_right(ts, tw + 200_000)], dtype=float)

    lead, early, late = (np.full((R + 1) * K, np.nan) for _ in range(3))
    ph = defaultdict(lambda: np.full((R + 1, 4), np.nan))  # (position, phase) → per replay: median, p90, latest, n
    for i, (gid, tw) in enumerate(order[-(R + 1) * K:]):
        d = tw - near(starts.get(gid, []), tw)
        if d.size:
            lead[i], early[i], late[i] = np.median(d), np.mean(d >= 500), -d.min()
        for p, ts in phases.get(gid, {}).items():
            d = near(ts, tw) - tw
            if d.size:
                ph[i % K, p][i // K] = np.median(d), np.percentile(d, 90), d.max(), d.size
    lead = np.nanmedian(lead.reshape(R + 1, K)[:-1], axis=0) / 1e3
    early = np.nanmedian(early.reshape(R + 1, K)[:-1], axis=0)
    late = np.nanmedian(late.reshape(R + 1, K)[:-1], axis=0) / 1e3
    step_ns = t[1:, 0] - t[:-1, 0]                  # first kernel to the next step's first kernel
    delta = np.empty((R, K))
    delta[:, :-1] = t[:-1, 1:] - t[:-1, :-1]        # kernel i's share: its record to kernel i+1's
    delta[:, -1] = t[1:, 0] - t[:-1, -1]             # the last kernel's share runs into the next step
    per = np.median(delta, axis=0) / 1e3             # µs per position in the step
    short = demangle(names)

    by = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for n, us, ld, ea, la in zip(short, per, lead, early, late):
        by[n][0] += 1
        by[n][1] += us
        by[n][2] += ld
        by[n][3] += ea
        by[n][4] += la
    step_us = float(np.median(step_ns)) / 1e3
    print(f"context {args.context}: {K} kernels per step, step {step_us:.1f} µs (median of {R}; "
          f"{1e6 / step_us:.1f} tok/s), sum of medians {per.sum():.1f} µs")
    print(f"{'kernel':<48} {'calls':>5} {'µs/call':>8} {'µs/step':>8} {'share':>6} {'lead µs':>8} {'early':>6} "
          f"{'last µs':>8}")
    for n, (c, us, ld, ea, la) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"{n[:48]:<48} {c:>5} {us / c:>8.2f} {us:>8.1f} {100 * us / per.sum():>5.1f}% {ld / c:>8.2f} "
              f"{100 * ea / c:>5.0f}% {la / c:>8.2f}")
    print("\nthe first kernels of the step, in order (µs each: share, lead; early; last):")
    for i in range(min(K, 40)):
        print(f"  {i:>3} {short[i][:60]:<60} {per[i]:7.2f} {lead[i]:7.2f} {100 * early[i]:5.0f}% {late[i]:7.2f}")
    # Phases, by kernel: µs after each launch's wait (medians over the replays, means over the kernel's launches).
    pk = defaultdict(lambda: defaultdict(list))
    for (k, p), v in ph.items():
        pk[short[k]][p].append(list(np.nanmedian(v[:-1], axis=0)) + [per[k]])
    if pk:
        print("\nphases, µs after the launch's wait: median over its blocks, 90th percentile, its latest block, blocks"
              " recorded; then the latest to the next kernel's wait")
    for n, byp in pk.items():
        print(f"  {n}")
        for p, rows in sorted(byp.items()):
            med, p90, mx, nb, nxt = np.mean(rows, axis=0)
            print(f"    phase {p:>2}: {med / 1e3:7.2f} {p90 / 1e3:7.2f} {mx / 1e3:7.2f} {nb:6.0f}  {nxt - mx / 1e3:6.2f}")
    print("the last kernels:")
    for i in range(max(0, K - 8), K):
        print(f"  {i:>3} {short[i][:60]:<60} {per[i]:7.2f} {lead[i]:7.2f} {100 * early[i]:5.0f}% {late[i]:7.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"context": args.context, "steps": R, "step_us": step_us, "disable": off,
                       "kernels": [{"name": n, "us": round(float(u), 3), "lead_us": round(float(ld), 3),
                                    "early": round(float(ea), 3), "last_us": round(float(la), 3)}
                                   for n, u, ld, ea, la in zip(short, per, lead, early, late)],
                       "phases": {n: {p: [round(float(x), 1) for x in np.mean(rows, axis=0)[:4]]
                                      for p, rows in sorted(byp.items())} for n, byp in pk.items()}},
                      f, indent=1)


if __name__ == "__main__":
    main()
