"""Whole-model benchmark at the exact Qwen3.6-35B-A3B geometry with random weights in the MLX 4-bit layout
(lily.tiny.build_random: no 19 GB download). Sweeps prefill over prompt lengths and decode at the same context
lengths, batch 1, and writes JSON plus a PNG plot.

    python benchmarks/bench_model.py --backend cuda --out benchmarks/results/h200.json
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

import lily
from lily.tiny import build_random

# architecture.md §1
FULL_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}
LENGTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
WEIGHT_BYTES = 1.670e9           # architecture.md §10.1: weights read per decoded token
STATE_BYTES = 125.8e6 + 2.9e6    # GDN recurrent state read + write, conv state
KV_BYTES_PER_TOKEN = 20480       # KV cache bytes read per token of context (10 layers × K, V × 2 heads × 256 × 2 B)


def prefill_flops(L: int) -> float:
    return L * (4.873e9 + 0.110e9 + 0.002e9) + 81920.0 * L * (L + 1) + 1.017e9


def decode_bytes(ctx: int) -> float:
    return WEIGHT_BYTES + STATE_BYTES + KV_BYTES_PER_TOKEN * ctx


def run(backend: str, lengths: list[int], decode_tokens: int, chunk: int, budget_s: float) -> dict:
    t = time.perf_counter()
    ckpt = build_random(FULL_TEXT_CONFIG, seed=0)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    model = lily.Model(ckpt, backend)
    load_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    rows, spent = [], 0.0
    for L in lengths:
        if spent > budget_s:
            rows.append({"length": L, "skipped": f"time budget of {budget_s:.0f} s spent"})
            continue
        session = model.session(max_context=L + decode_tokens + 8, prefill_chunk=chunk)
        prompt = rng.integers(0, model.n_valid, L).tolist()
        model.core.reset_peak_memory()
        t0 = time.perf_counter()
        stamps, out = [], []
        for r in lily.stream_generate(model, prompt, session=session, max_tokens=decode_tokens, temperature=0.0):
            stamps.append(time.perf_counter())
            out.append(r)
        total = time.perf_counter() - t0
        spent += total
        last = out[-1]
        prefill_s = L / last.prompt_tps
        # steady state: skip the first steps (eager run and graph capture of the decode step)
        skip = min(4, len(stamps) - 2)
        decode_tps = (len(stamps) - 1 - skip) / (stamps[-1] - stamps[skip])
        row = {"length": L, "prefill_s": prefill_s, "prefill_tok_s": last.prompt_tps,
               "prefill_tflop_s": prefill_flops(L) / prefill_s / 1e12,
               "decode_tokens": last.generation_tokens, "decode_tok_s": decode_tps,
               "decode_gb_s": decode_bytes(L) * decode_tps / 1e9, "peak_memory_gb": model.core.peak_memory / 1e9}
        rows.append(row)
        print(f"L={L:>6}: prefill {last.prompt_tps:>9.0f} tok/s ({row['prefill_tflop_s']:.1f} TFLOP/s)  "
              f"decode {decode_tps:>7.1f} tok/s ({row['decode_gb_s']:.0f} GB/s)  peak {row['peak_memory_gb']:.1f} GB",
              flush=True)
    return {"backend": backend, "model": "Qwen3.6-35B-A3B geometry, random MLX 4-bit weights",
            "host": platform.node(), "prefill_chunk": chunk, "build_s": build_s, "load_s": load_s,
            "weight_bytes": model.core.weight_bytes, "results": rows}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if "skipped" not in r]
    L = [r["length"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(L, [r["prefill_tok_s"] for r in rows], "o-")
    a.set(xscale="log", xlabel="prompt length (tokens)", ylabel="prefill tok/s", title="Prefill")
    b.plot(L, [r["decode_tok_s"] for r in rows], "o-", color="C1")
    b.set(xscale="log", xlabel="context length (tokens)", ylabel="decode tok/s", title="Decode, batch 1")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"Lily {result['backend']}: {result['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cuda")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens per forward call)")
    p.add_argument("--budget", type=float, default=240.0, help="stop starting new lengths after this many seconds")
    p.add_argument("--out", default="benchmarks/results/bench_model.json")
    args = p.parse_args()
    result = run(args.backend, [int(x) for x in args.lengths.split(",")], args.decode_tokens, args.chunk, args.budget)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
