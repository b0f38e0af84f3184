"""CPU prefill against mlx-lm on the CPU: wall-clock time to the first token of a prompt, batch 1.

Lily runs its public default path (`lily.stream_generate(model, prompt_ids, max_tokens=1)`: a fresh session,
default prefill chunk, default thread count, default sampling). mlx-lm runs its own default generation loop
(`mlx_lm.generate.generate_step`, prefill step 2048) on the same checkpoint written to disk in the MLX layout and
loaded the way the correctness tests load it (tests/oracle.py: every floating parameter cast to float32, so both
engines compute in fp32 from the same 4-bit codes). Each engine gets one untimed warm-up on a short prompt, then
up to `--reps` timed runs per prompt length (no further one once they add up to `--rep-budget` seconds); the best
run is reported (noise on a shared machine only ever slows a run).

Models: "tiny" is `lily.load("tiny")` (lily.tiny.TINY_TEXT_CONFIG); "mid" is tests/test_cuda.py's mid-size geometry
(MID_TEXT_CONFIG: the real head sizes of Qwen3.6-35B-A3B, hidden 1024, 8 layers, 64 experts top-8, expert width 512).

    python benchmarks/bench_cpu.py --out benchmarks/results/cpu.json
    python benchmarks/bench_cpu.py --models tiny --lengths 512 --engines lily
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import lily
from lily.tiny import build_tiny, write_checkpoint
from lily.tiny_tokenizer import tiny_vocab_size

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_cuda import MID_TEXT_CONFIG  # noqa: E402

MODELS = {"tiny": lambda: build_tiny(), "mid": lambda: build_tiny(seed=7, text_config=MID_TEXT_CONFIG)}


def time_lily(model: lily.Model, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    next(iter(lily.stream_generate(model, prompt, max_tokens=1)))
    return time.perf_counter() - t0


def time_mlx(model, prompt: list[int]) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    token, _ = next(generate_step(mx.array(prompt, dtype=mx.int32), model, max_tokens=1,
                                  sampler=lambda logprobs: mx.argmax(logprobs, axis=-1)))
    int(token)  # generate_step yields an evaluated token; int() makes sure
    return time.perf_counter() - t0


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "lily_threads": int(os.environ.get("LILY_NUM_THREADS", 0)) or os.cpu_count()}
    try:
        import mlx.core as mx
        import mlx_lm

        info["mlx"], info["mlx_lm"] = mx.__version__, mlx_lm.__version__
    except ImportError:
        pass
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,mid", help="comma-separated: tiny, mid")
    p.add_argument("--lengths", default="512,4096", help="comma-separated prompt lengths")
    p.add_argument("--engines", default="lily,mlx", help="comma-separated: lily, mlx")
    p.add_argument("--reps", type=int, default=3, help="timed runs per point at most (the best is kept)")
    p.add_argument("--rep-budget", type=float, default=30.0,
                   help="no further run of a point once its runs took this many seconds")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args()
    engines = args.engines.split(",")
    lengths = [int(n) for n in args.lengths.split(",")]
    rows = []
    tmp = tempfile.TemporaryDirectory(prefix="lily-bench-")  # the MLX-layout checkpoints for mlx-lm
    print(f"{'model':<6} {'tokens':>7} {'engine':<6} {'seconds':>9} {'tok/s':>9}", flush=True)
    for name in args.models.split(","):
        ckpt = MODELS[name]()
        runners = {}
        if "lily" in engines:
            runners["lily"] = (lily.Model(ckpt, "cpu"), time_lily)
        if "mlx" in engines:
            import oracle  # tests/oracle.py: mlx-lm's model with every floating parameter in float32

            runners["mlx"] = (oracle.load_fp32_model(write_checkpoint(ckpt, Path(tmp.name) / name)), time_mlx)
        n_valid = tiny_vocab_size()  # prompt ids: tokens the tokenizer knows (no vocabulary padding)
        rng = np.random.default_rng(0)
        for engine, (m, timer) in runners.items():
            timer(m, rng.integers(0, n_valid, 16).tolist())  # warm-up: first-call costs are not prefill
        for L in lengths:
            prompt = rng.integers(0, n_valid, L).tolist()
            for engine, (m, timer) in runners.items():
                times = [timer(m, prompt)]
                while len(times) < args.reps and sum(times) < args.rep_budget:
                    times.append(timer(m, prompt))
                best = min(times)
                rows.append({"model": name, "tokens": L, "engine": engine, "seconds": best, "tok_s": L / best,
                             "runs": times})
                print(f"{name:<6} {L:>7} {engine:<6} {best:>9.3f} {L / best:>9.1f}", flush=True)
    if args.out:
        result = {"machine": machine(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
                  "models": {"tiny": "lily.tiny.TINY_TEXT_CONFIG (lily.load('tiny'))",
                             "mid": "tests/test_cuda.py MID_TEXT_CONFIG, build_tiny(seed=7)"},
                  "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
