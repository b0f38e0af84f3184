"""Where the time goes: one prefill chunk and one replayed decode step at the full Qwen3.6-35B-A3B geometry
(random MLX 4-bit weights), kernel by kernel, under Nsight Compute. The profiled region is opened and closed with
the driver's cuProfilerStart/Stop, so run it as

    ncu --profile-from-start off --clock-control none --csv \
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
        python benchmarks/profile_step.py --context 4096 [--prefix 28672] > kernels.csv
    python benchmarks/profile_step.py --summarize kernels.csv

Decode kernels are nodes of the replayed CUDA graph (ncu profiles graph nodes one by one, so the times exclude the
overlap between kernels that the graph allows; their sum is an upper bound of the step).
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import io
import re
from collections import defaultdict


def profile(context: int, chunk: int, prefix: int, what: str) -> None:
    import numpy as np

    import lily
    from lily import _core
    from lily.bench import random_model

    cuda = ctypes.CDLL("libcuda.so.1")
    model = random_model("cuda")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.n_valid, context).astype(np.int32)
    if "prefill" in what:
        tokens = rng.integers(0, model.n_valid, prefix + chunk).astype(np.int32)
        s = model.core.session(max_context=prefix + chunk + 64, prefill_chunk=chunk)
        for profiled in (False, True):  # the first pass warms: scratch buffers reach their sizes
            s.reset()
            if prefix:
                s.prefill(tokens[:prefix])
            if profiled:
                cuda.cuProfilerStart()
            s.prefill(tokens[prefix:])
        cuda.cuProfilerStop()
    if "decode" in what:
        s = model.core.session(max_context=context + 64, prefill_chunk=chunk)
        g = _core.Generator(s, lily.SamplingParams(temperature=0.0).to_core(), [], 16, model.n_valid)
        g.prefill(prompt)
        for _ in range(6):  # eager step, captured step, replays
            g.next()
        cuda.cuProfilerStart()
        g.next()  # enqueues one replayed step (and waits for the previous token)
        g.next()
        cuda.cuProfilerStop()


def summarize(path: str, top: int) -> None:
    text = open(path).read()
    text = text[text.index('"ID"'):]  # ncu prints its own lines before the CSV
    per = defaultdict(lambda: {"n": 0, "us": 0.0, "bytes": 0.0})
    order, total_us, total_bytes = [], 0.0, 0.0
    rows = defaultdict(dict)
    for r in csv.DictReader(io.StringIO(text)):
        key = r["ID"]
        name = re.sub(r"\(.*", "", r["Kernel Name"]).strip()
        rows[key]["name"] = name
        v = float(r["Metric Value"].replace(",", ""))
        unit = r["Metric Unit"]
        if r["Metric Name"] == "gpu__time_duration.sum":
            rows[key]["us"] = v * {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                                   "msecond": 1e3}[unit]
        else:
            scale = {"byte": 1, "Kbyte": 1e3, "KB": 1e3, "Mbyte": 1e6, "MB": 1e6, "Gbyte": 1e9, "GB": 1e9}[unit]
            rows[key]["bytes"] = rows[key].get("bytes", 0.0) + v * scale
    for key, r in rows.items():
        p = per[r["name"]]
        p["n"] += 1
        p["us"] += r.get("us", 0.0)
        p["bytes"] += r.get("bytes", 0.0)
        total_us += r.get("us", 0.0)
        total_bytes += r.get("bytes", 0.0)
    print(f"{len(rows)} kernels, {total_us:.1f} µs in all, {total_bytes / 1e9:.3f} GB of DRAM traffic")
    print(f"{'kernel':60s} {'n':>5s} {'µs':>10s} {'µs each':>9s} {'GB/s':>7s} {'share':>6s}")
    for name, p in sorted(per.items(), key=lambda kv: -kv[1]["us"])[:top]:
        print(f"{name[:60]:60s} {p['n']:5d} {p['us']:10.1f} {p['us'] / p['n']:9.2f} "
              f"{p['bytes'] / max(p['us'], 1e-9) / 1e3:7.0f} {p['us'] / total_us:6.1%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096, help="prompt tokens before the profiled decode step")
    p.add_argument("--chunk", type=int, default=4096, help="the profiled prefill chunk")
    p.add_argument("--prefix", type=int, default=0,
                   help="prompt tokens prefilled (unprofiled) before the profiled chunk: its attention sees them")
    p.add_argument("--what", default="prefill,decode")
    p.add_argument("--summarize", metavar="CSV", help="summarize an ncu CSV written by a profiled run")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize, args.top)
    else:
        profile(args.context, args.chunk, args.prefix, args.what)


if __name__ == "__main__":
    main()
