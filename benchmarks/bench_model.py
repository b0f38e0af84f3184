"""Whole-model benchmark at the exact Qwen3.6-35B-A3B geometry with random weights in the MLX 4-bit layout: the
public default path (lily.stream_generate with the model's defaults) at each prompt length, as `lily bench --model
random` runs it; JSON + PNG. --ablate repeats 4K/32K/128K with each optimisation off alone.

    python benchmarks/bench_model.py --backend cuda --out benchmarks/results/h200.json
    python benchmarks/bench_model.py --backend cuda --ablate --out benchmarks/results/h200_ablation.json
"""
import sys

from lily.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "--model", "random", *sys.argv[1:]]))
