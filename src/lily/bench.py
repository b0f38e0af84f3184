"""`lily bench`: prefill and decode speed against context length, measured on the path users run.

Each point is one `lily.stream_generate(model, prompt, max_tokens=N)` call with the model's own defaults (its
sampling settings, the backend's prefill chunk), after one untimed warm-up generation: prefill speed is the prompt
length over the wall-clock time to the first token, decode speed the steady rate of the tokens after it, each the
median of --repeats generations (default 3) up to 32K tokens. The result
is JSON (what was measured, on what, with which defaults) and, where matplotlib is installed, a PNG with the roofline
of the device drawn in when it is known. `--ablate` repeats a few lengths with each optimisation turned off alone
(lily.optimisations(): those that act on the backend in use).
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np

import lily

# The Qwen3.6-35B-A3B text model (architecture.md §1), for `--model random`: its exact geometry with random MLX 4-bit
# weights (lily.tiny.build_random), the speed of the real checkpoint without its 19 GB.
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
ABLATION_LENGTHS = [4096, 32768, 131072]
# Measured ceilings (shared/docs/h200-facts.md): dense bf16 matrix rate and device-to-device copy rate.
CEILINGS = {"NVIDIA H200": {"flops": 790e12, "bytes_per_s": 4.25e12}}


def _qbytes(n: int, k: int, bits: int = 4, group: int = 64) -> float:
    """Bytes of an MLX affine-quantized [n, k] matrix: codes plus bf16 scales and biases."""
    return n * k * bits / 8 + n * (k // group) * 4


def decode_bytes(c: dict, context: int) -> float:
    """Bytes one decoded token reads at a context length: the active weights (4-bit, 8-bit router and shared-expert
    gate; k of E experts), the Gated DeltaNet states (read and written) and the KV rows of every attention layer."""
    H, L = c["hidden_size"], c["num_hidden_layers"]
    n_attn = L // c["full_attention_interval"]
    NH, NKV, HD = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    NK, NV, DK, DV = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    E, k, I, IS = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], c[
        "shared_expert_intermediate_size"]
    conv, value = 2 * NK * DK + NV * DV, NV * DV
    attn = _qbytes(2 * NH * HD, H) + 2 * _qbytes(NKV * HD, H) + _qbytes(H, NH * HD)
    gdn = _qbytes(conv, H) + _qbytes(value, H) + 2 * _qbytes(NV, H) + _qbytes(H, value)
    moe = _qbytes(E, H, 8) + _qbytes(1, H, 8) + (k + 1) * (2 * _qbytes(I, H) + _qbytes(H, I))
    weights = n_attn * attn + (L - n_attn) * gdn + L * moe + _qbytes(c["vocab_size"], H)
    state = (L - n_attn) * (2 * NV * DV * DK * 4 + 2 * (c.get("linear_conv_kernel_dim", 4) - 1) * conv * 2)
    return weights + state + n_attn * 2 * NKV * HD * 2 * context


def prefill_flops(c: dict, length: int) -> float:
    """FLOPs of prefilling `length` tokens from an empty state: every active matrix once per token, the Gated
    DeltaNet recurrence and conv, causal attention over the growing context, and the lm_head for the last token only
    (architecture.md §10: 21.8 TFLOP for 4096 tokens)."""
    H, L = c["hidden_size"], c["num_hidden_layers"]
    n_attn = L // c["full_attention_interval"]
    NH, NKV, HD = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    NK, NV, DK, DV = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    E, k, I, IS = c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], c[
        "shared_expert_intermediate_size"]
    attn = 2 * NH * HD * H + 2 * NKV * HD * H + NH * HD * H
    gdn = (2 * NK * DK + NV * DV) * H + NV * DV * H + 2 * NV * H + H * NV * DV
    moe = E * H + H + 3 * k * I * H + 3 * IS * H
    # + per GDN layer the delta rule (~7 FLOP per state element) and the causal conv (2 per tap and channel)
    recurrence = 7 * NV * DV * DK + 2 * c.get("linear_conv_kernel_dim", 4) * (2 * NK * DK + NV * DV)
    per_token = 2 * (n_attn * attn + (L - n_attn) * gdn + L * moe) + (L - n_attn) * recurrence
    return per_token * length + 4 * NH * HD * n_attn * length * (length + 1) / 2 + 2 * c["vocab_size"] * H


def measure(model: lily.Model, length: int, decode_tokens: int, rng: np.random.Generator, **sampling) -> dict:
    """One default-path generation from a random prompt of `length` tokens."""
    prompt = rng.integers(0, model.n_valid, length).tolist()
    model.core.reset_peak_memory()
    t0 = time.perf_counter()
    stamps = []
    for _ in lily.stream_generate(model, prompt, max_tokens=decode_tokens, **sampling):
        stamps.append(time.perf_counter())
    ttft = stamps[0] - t0
    skip = min(4, len(stamps) - 2)  # the first steps run eagerly and record the decode step
    decode = (len(stamps) - 1 - skip) / (stamps[-1] - stamps[skip]) if len(stamps) > skip + 1 else float("nan")
    return {"length": length, "ttft_s": ttft, "prefill_tok_s": length / ttft, "decode_tokens": len(stamps),
            "decode_tok_s": decode, "peak_memory_gb": model.core.peak_memory / 1e9}


# Prompts up to this long are measured `repeats` times (medians reported: one generation moves by ~±1.5 % on the
# H200); longer ones, which take seconds each, once.
REPEAT_MAX_LENGTH = 32768


def median_of(runs: list[dict]) -> dict:
    """One row from repeated measurements of one length: the median of each speed, the largest peak, and the
    samples."""
    row = dict(runs[0])
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
        row[key] = float(np.median([r[key] for r in runs]))
    row["peak_memory_gb"] = max(r["peak_memory_gb"] for r in runs)
    row["runs"] = len(runs)
    if len(runs) > 1:
        row["samples"] = {k: [r[k] for r in runs] for k in ("prefill_tok_s", "decode_tok_s")}
    return row


def sweep(model: lily.Model, lengths: list[int], decode_tokens: int, budget_s: float, greedy_too: bool = False,
          log=print, repeats: int = 3) -> list[dict]:
    rng = np.random.default_rng(0)
    c, rows, t_start = model.config, [], time.perf_counter()
    # One untimed generation first, as llama-bench and mlx_lm.benchmark do: a process's first one also loads each
    # kernel (lazy module loading) and grows the scratch buffers to a full prefill chunk's size, which the
    # generations after it do not pay.
    measure(model, min(min(lengths, default=1), model.core.default_prefill_chunk), 4, rng)
    for L in lengths:
        if time.perf_counter() - t_start > budget_s:
            rows.append({"length": L, "skipped": f"time budget of {budget_s:.0f} s spent"})
            continue
        if L + decode_tokens > c["max_position_embeddings"]:
            rows.append({"length": L, "skipped": "longer than max_position_embeddings"})
            continue
        row = median_of([measure(model, L, decode_tokens, rng)
                         for _ in range(repeats if L <= REPEAT_MAX_LENGTH else 1)])
        row["prefill_tflop_s"] = prefill_flops(c, L) / row["ttft_s"] / 1e12
        row["decode_gb_s"] = decode_bytes(c, L) * row["decode_tok_s"] / 1e9
        if greedy_too:
            row["decode_greedy_tok_s"] = measure(model, L, decode_tokens, rng, temperature=0.0)["decode_tok_s"]
        rows.append(row)
        log(f"L={L:>6}: prefill {row['prefill_tok_s']:>9.0f} tok/s ({row['prefill_tflop_s']:6.1f} TFLOP/s)  "
            f"decode {row['decode_tok_s']:>7.1f} tok/s ({row['decode_gb_s']:5.0f} GB/s)"
            + (f" greedy {row['decode_greedy_tok_s']:.1f}" if greedy_too else "")
            + f"  peak {row['peak_memory_gb']:.2f} GB")
    return rows


def describe(model: lily.Model, name: str) -> dict:
    ceil = CEILINGS.get(model.core.device)
    return {"path": "default", "model": name, "backend": model.backend, "device": model.core.device,
            "host": platform.node(), "prefill_chunk": model.core.default_prefill_chunk,
            "sampling": "the model's generation_config.json", "n_valid": model.n_valid, "disabled": model.disabled,
            "warmup": "one untimed generation of min(first length, prefill chunk) tokens before the sweep",
            "repeats": f"the median of `runs` generations per length up to {REPEAT_MAX_LENGTH} tokens, one above",
            "lily_version": lily.__version__, "ceilings": ceil}


def plot(result: dict, path: Path) -> bool:
    """PNG of prefill and decode speed against length, with the roofline when the device's ceilings are known.
    False when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if "skipped" not in r]
    L = [r["length"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(L, [r["prefill_tok_s"] for r in rows], "o-", label="Lily (default path)")
    b.plot(L, [r["decode_tok_s"] for r in rows], "o-", color="C1", label="Lily (default path)")
    ceil, c = result.get("ceilings"), result.get("config")
    if ceil and c:
        a.plot(L, [n * ceil["flops"] / prefill_flops(c, n) for n in L], "--", color="gray",
               label=f"roofline ({ceil['flops'] / 1e12:.0f} TFLOP/s)")
        b.plot(L, [ceil["bytes_per_s"] / decode_bytes(c, n) for n in L], "--", color="gray",
               label=f"roofline ({ceil['bytes_per_s'] / 1e12:.2f} TB/s)")
    a.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="tok/s", title="Prefill")
    b.set(xscale="log", yscale="log", xlabel="context length (tokens)", ylabel="tok/s", title="Decode, batch 1")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    model = "Qwen3.6-35B-A3B geometry, random 4-bit weights" if result["model"] == "random" else result["model"]
    fig.suptitle(f"Lily on {result['device']} ({result['backend']}): {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# The real tokenizer's ids (architecture.md §11: rows 248,077.. of the lm_head's 248,320 are padding). The random
# model's built-in tokenizer knows a few hundred, and token selection scans only the valid ids: without this the
# benchmark's sampler would do a few hundredth of the product's work.
FULL_N_VALID = 248077


def random_model(backend: str, disable=None, ckpt=None) -> lily.Model:
    """The full geometry with random weights (`ckpt`, else built here), selecting among the real vocabulary's ids."""
    from lily.tiny import build_random

    model = lily.Model(ckpt if ckpt is not None else build_random(FULL_TEXT_CONFIG, seed=0), backend, disable)
    model.n_valid = FULL_N_VALID
    return model


def load_for_bench(name: str, backend: str, disable=None) -> lily.Model:
    if name == "random":
        return random_model(backend, disable)
    return lily.load(name, backend=backend, disable=disable)


def run(name: str, backend: str, lengths: list[int], decode_tokens: int, budget_s: float, out: Path,
        greedy_too: bool = False, log=print, repeats: int = 3) -> dict:
    model = load_for_bench(name, backend)
    model.eos_token_ids = []  # a benchmark generates its token count whatever the random weights say
    log(f"lily bench: {model.backend} on {model.core.device}, prefill chunk {model.core.default_prefill_chunk}, "
        f"default sampling")
    result = {**describe(model, name), "config": model.config,
              "results": sweep(model, lengths, decode_tokens, budget_s, greedy_too, log, repeats)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    png = out.with_suffix(".png")
    log(f"wrote {out}" + (f" and {png}" if plot(result, png) else " (no plot: matplotlib is not installed)"))
    return result


def acts_on(backends: str, backend: str) -> bool:
    """Whether a switch whose table entry lists `backends` ("cuda", "cuda,metal", ...) changes anything on `backend`."""
    return backend in backends.split(",")


def ablate(name: str, backend: str, lengths: list[int], decode_tokens: int, out: Path, log=print,
           repeats: int = 3) -> dict:
    """The default path with everything on, then with each optimisation off alone: each switch that acts on the
    backend the model runs on (one that does not would repeat the all-on sweep, minutes a length on the full model)."""
    from lily.tiny import build_random

    ckpt = build_random(FULL_TEXT_CONFIG, seed=0) if name == "random" else None
    runs, meta, ran = {}, None, None
    for off, backends in [(None, "")] + [(n, b) for n, b, _ in lily.optimisations()]:
        if off is not None and not acts_on(backends, ran):
            log(f"-- {off}: does not act on {ran}, not run")
            continue
        disable = [off] if off else None
        model = random_model(backend, disable, ckpt) if ckpt is not None else lily.load(name, backend, disable=disable)
        model.eos_token_ids = []
        meta = meta or {**describe(model, name), "disabled": "one switch at a time"}
        ran = model.backend
        log(f"-- {'all on' if off is None else off + ' off'}")
        runs[off or "all on"] = sweep(model, lengths, decode_tokens, float("inf"), log=log, repeats=repeats)
        del model
    switches = {n: {"backends": b, "what": w, "acts_here": acts_on(b, ran)} for n, b, w in lily.optimisations()}
    result = {**meta, "switches": switches, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    log(ablation_table(result))
    return result


def ablation_table(result: dict) -> str:
    """Markdown: for each switch, decode and prefill with it off against all on, and the gain of having it on."""
    base = {r["length"]: r for r in result["runs"]["all on"]}
    lengths = sorted(base)
    head = "| switch | what it does | " + " | ".join(
        f"decode {L // 1024}K off → on (gain)" for L in lengths) + " | " + " | ".join(
        f"prefill {L // 1024}K off → on (gain)" for L in lengths) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(lengths))]
    for name, info in result["switches"].items():
        if name not in result["runs"]:
            cells = ["— (not on this backend)"] * (2 * len(lengths))
            lines.append(f"| `{name}` | {info['what']} | " + " | ".join(cells) + " |")
            continue
        runs = {r["length"]: r for r in result["runs"][name]}
        cells = []
        for key in ("decode_tok_s", "prefill_tok_s"):
            for L in lengths:
                off, on = runs[L][key], base[L][key]
                cells.append(f"{off:,.0f} → {on:,.0f} ({(on / off - 1):+.1%})")
        lines.append(f"| `{name}` | {info['what']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
