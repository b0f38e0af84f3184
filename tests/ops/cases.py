"""The op case table: every Backend op at the real Qwen3.6-35B-A3B shapes and at odd shapes. It drives the op test
(tests/ops/test_ops.py: each GPU backend against the CPU reference) and the op benchmark (benchmarks/bench_ops.py).

Letters follow architecture.md §1. Inputs are drawn fresh for every run (pass an np.random.Generator) and
activations are rounded to bf16 first, so the CPU reference and a bf16 backend see identical values.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lily.safetensors_io import bf16_to_float32, float32_to_bf16


@dataclass(frozen=True)
class Case:
    op: str                 # the Backend method (and C++/CUDA file stem)
    dims: dict              # sizes and flags, architecture.md letters
    tol: float = 2e-2       # bound on ‖got − ref‖ / ‖ref‖ (bf16 activations, fp32 accumulation)
    # "model" (a real shape), "edge" (odd sizes), "slow" (big inputs), "gpu" (sized for the GPU kernels' tiles: the
    # Metal CPU harness skips it, minutes there for no kernel of its own)
    tags: tuple = ()
    name: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.name or f"{self.op}-" + "-".join(f"{k}{v}" for k, v in self.dims.items())

    def bytes(self) -> int:
        return _traffic(self)

    def flops(self) -> int:
        return _flops(self)


def bf16(x: np.ndarray) -> np.ndarray:
    """Rounds to the nearest bf16 value, as float32."""
    return bf16_to_float32(float32_to_bf16(np.asarray(x, dtype=np.float32)))


def qmatrix(rng, name: str, E: int, N: int, K: int, bits: int = 4, group: int = 64, std: float = 1.0) -> tuple:
    """A random quantized matrix (codes, scales, biases) whose dequantised entries have roughly the given std."""
    lead = (E, N) if E else (N,)
    words = rng.integers(0, 2**32, size=lead + (K * bits // 32,), dtype=np.uint64).astype(np.uint32)
    levels = 2**bits - 1
    scale = rng.normal(0.0, 1.0, size=lead + (K // group,)).astype(np.float32) * (std * 3.4 / levels)
    bias = (-scale * levels / 2 + rng.normal(0, std * 0.05, size=scale.shape)).astype(np.float32)
    inputs = {f"{name}.w": words, f"{name}.scales": float32_to_bf16(scale), f"{name}.biases": float32_to_bf16(bias)}
    return inputs, {f"{name}.K": K}


def _act(rng, shape, std=1.0):
    return bf16(rng.normal(0.0, std, size=shape))


def _spread(rng, shape):
    """bf16 activations whose magnitudes span ~2^±12, with runs of 32 zeros: a fixed-point staging of x (CUDA's
    qmv_dp4a scales each chunk by its largest element) must keep the small ones and survive an all-zero chunk."""
    x = rng.normal(0.0, 1.0, size=shape) * np.exp2(rng.normal(0.0, 4.0, size=shape))
    x.reshape(-1, 32)[::5] = 0.0
    return bf16(x)


def dequantize(words, scales, biases, bits: int, group: int) -> np.ndarray:
    """The float64 matrix [N, K] of MLX affine codes (LSB first), bf16 scales and biases."""
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    q = ((words[..., None] >> shifts) & np.uint32(2**bits - 1)).reshape(words.shape[0], -1).astype(np.float64)
    s, b = (np.repeat(bf16_to_float32(v).astype(np.float64), group, axis=1) for v in (scales, biases))
    return s * q + b


# Smallest gap between a token's k-th and (k+1)-th router logit in the MoE cases (logits have std ~3). A backend
# that rounds the router's weights to bf16 for its tensor cores moves a logit by ~0.006: a smaller gap is a tie it
# may break the other way, which swaps an expert and fails the case without any kernel being wrong.
ROUTING_MARGIN = 0.05


def _clear_routing(rng, m: np.ndarray, router: np.ndarray, k: int) -> np.ndarray:
    """m (bf16 values) with every token redrawn until its top-k experts lead the rest by ROUTING_MARGIN."""
    for _ in range(1000):
        top = -np.sort(-(m @ router.T), axis=1)
        tied = top[:, k - 1] - top[:, k] < ROUTING_MARGIN
        if not tied.any():
            return m
        m[tied] = bf16(rng.normal(0, 1.0, size=(int(tied.sum()), m.shape[1])))
    raise RuntimeError("could not draw MoE inputs with clear routing")


def make(case: Case, rng: np.random.Generator) -> tuple[dict, dict]:
    """(params, inputs) for lily._core.testing.run_op."""
    d, op = dict(case.dims), case.op
    p, x = dict(d), {}
    if op == "embed":
        q, kp = qmatrix(rng, "table", 0, d["V"], d["H"], d.get("bits", 4))
        x.update(q), p.update(kp)
        x["tokens"] = rng.integers(0, d["V"], size=d["T"]).astype(np.int32)
    elif op in ("rms_norm", "add_rms_norm"):
        p["eps"] = 1e-6
        x["x"] = rng.normal(0, 2.0, size=(d["T"], d["H"])).astype(np.float32)
        x["w"] = (1.0 + rng.normal(0, 0.1, size=d["H"])).astype(np.float32)
        if op == "add_rms_norm":
            x["d"] = _act(rng, (d["T"], d["H"]))
    elif op == "qmm":
        q, kp = qmatrix(rng, "W", 0, d["N"], d["K"], d.get("bits", 4), d.get("group", 64), std=d["K"] ** -0.5)
        x.update(q), p.update(kp)
        x["x"] = (_spread if d.get("spread") else _act)(rng, (d["T"], d["K"]))
    elif op == "qmm_multi":
        for i, n in enumerate(d["Ns"]):
            q, kp = qmatrix(rng, f"W{i}", 0, n, d["K"], d.get("bits", 4), std=d["K"] ** -0.5)
            x.update(q), p.update(kp)
        p["n"] = len(d["Ns"])
        x["x"] = _act(rng, (d["T"], d["K"]))
    elif op == "rms_norm_qmm":
        for i, n in enumerate(d["Ns"]):
            q, kp = qmatrix(rng, f"W{i}", 0, n, d["K"], d.get("bits", 4), std=d["K"] ** -0.5)
            x.update(q), p.update(kp)
        p.update(n=len(d["Ns"]), eps=1e-6)
        x["x"] = rng.normal(0, 2.0, size=(d["T"], d["K"])).astype(np.float32)
        x["w"] = (1.0 + rng.normal(0, 0.1, size=d["K"])).astype(np.float32)
    elif op == "attention":
        T, NH, NKV, HD, pos0 = d["T"], d["NH"], d["NKV"], d["HD"], d["pos0"]
        p.update(cache_cap=pos0 + T + d.get("spare", 3), rotary_dim=d.get("rotary_dim", HD // 4),
                 rope_theta=1e7, eps=1e-6)
        x["qg"] = _act(rng, (T, NH, 2 * HD))
        x["k"], x["v"] = _act(rng, (T, NKV * HD)), _act(rng, (T, NKV * HD))
        x["q_norm"] = (1.0 + rng.normal(0, 0.1, HD)).astype(np.float32)
        x["k_norm"] = (1.0 + rng.normal(0, 0.1, HD)).astype(np.float32)
        cache = (p["cache_cap"], NKV, HD)
        x["k_cache"] = _act(rng, cache)  # rows ≥ pos0 are garbage the op must overwrite
        x["v_cache"] = _act(rng, cache)
    elif op.startswith("gdn"):
        T, NK, NV, DK, DV = d["T"], d["NK"], d["NV"], d["DK"], d["DV"]
        K = d.get("conv_kernel", 4)
        p.update(conv_kernel=K, eps=1e-6)
        C = 2 * NK * DK + NV * DV
        if op in ("gdn_conv", "gdn_conv_scan_norm"):
            x["x"] = _act(rng, (T, C))
            x["w" if op == "gdn_conv" else "conv_w"] = rng.normal(0, 0.5, size=(C, K)).astype(np.float32)
            x["conv_state"] = _act(rng, (K - 1, C))
        if op in ("gdn_scan", "gdn_conv_scan_norm"):
            if op == "gdn_scan":
                x["c"] = _act(rng, (T, C))
            x["b"], x["alpha"] = _act(rng, (T, NV)), _act(rng, (T, NV))
            x["A_log"] = np.log(rng.uniform(0.05, 1.0, NV)).astype(np.float32)
            x["dt_bias"] = rng.normal(-1.0, 0.5, NV).astype(np.float32)
            x["state"] = rng.normal(0, 0.1, size=(NV, DV, DK)).astype(np.float32)
            if op == "gdn_conv_scan_norm":
                x["z"] = _act(rng, (T, NV * DV))
                x["w"] = (1.0 + rng.normal(0, 0.1, DV)).astype(np.float32)
        elif op == "gdn_norm":
            x["y"], x["z"] = _act(rng, (T, NV * DV)), _act(rng, (T, NV * DV))
            x["w"] = (1.0 + rng.normal(0, 0.1, DV)).astype(np.float32)
    elif op in ("moe", "moe_residual"):
        T, H, E, I, IS = d["T"], d["H"], d["E"], d["I"], d["IS"]
        p["norm_topk_prob"] = True
        eb, gb = d.get("bits", 4), d.get("gate_bits", 8)  # experts (routed and shared); router and shared gate
        for name, e, n, k, bits in (("router", 0, E, H, gb), ("gate", E, I, H, eb), ("up", E, I, H, eb),
                                    ("down", E, H, I, eb), ("shared_gate", 0, IS, H, eb), ("shared_up", 0, IS, H, eb),
                                    ("shared_down", 0, H, IS, eb), ("shared_expert_gate", 0, 1, H, gb)):
            group = d.get("group", 64) if name in ("gate", "up", "down") else 64  # the routed experts' group size
            q, kp = qmatrix(rng, name, e, n, k, bits, group, std=k ** -0.5 * (3.0 if name == "router" else 1.0))
            x.update(q), p.update(kp)
        m = bf16(rng.normal(0, 1.0, size=(T, H)))
        if d.get("skewed"):  # every token picks the same experts: whole-T groups (1, 2, 127 rows per expert)
            m = np.abs(m)
            s = np.zeros((E, H // 64), np.float32)
            # tied: router rows equal by level, so their logits are bit for bit equal (an expert e sits in lane
            # e mod 32 of a CUDA warp's pick): "lanes" ties e with e + 32 (one lane), "pairs" ties 2l, 2l + 1 and
            # their + 32 (two lanes and within each). The lower id goes first.
            level = {"lanes": np.arange(E) % 32, "pairs": np.arange(E) % 32 // 2}.get(d.get("tied"), np.arange(E))
            b = (0.02 * (1.0 - level / (level.max() + 1.0))).astype(np.float32)[:, None] * np.ones((1, H // 64))
            x["router.scales"], x["router.biases"] = float32_to_bf16(s), float32_to_bf16(b)
        else:
            router = dequantize(x["router.w"], x["router.scales"], x["router.biases"], gb, 64)
            m = _clear_routing(rng, m.astype(np.float64), router, d["top_k"]).astype(np.float32)
        if op == "moe":
            x["m"] = m
        else:  # x + y·W_oᵀ whose RMSNorm (unit weight) is m: the routing margin of m carries over
            p["eps"] = 1e-6
            x["w"] = np.ones(H, np.float32)
            KO = d.get("KO", 2 * H)  # the mixer's width (the output projection's K)
            ob = d.get("o_bits", 4)
            q, kp = qmatrix(rng, "o", 0, H, KO, ob, std=KO ** -0.5)
            x.update(q), p.update(kp)
            x["y"] = _act(rng, (T, KO))
            proj = x["y"].astype(np.float64) @ dequantize(x["o.w"], x["o.scales"], x["o.biases"], ob, 64).T
            scale = np.sqrt(np.mean(m.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-6)
            x["x"] = (m.astype(np.float64) * scale * rng.uniform(0.5, 2.0, size=(T, 1)) - proj).astype(np.float32)
    else:
        raise ValueError(f"unknown op {op!r}")
    return p, x


# Outputs updated in place whose change, not their value, is the op's result (the residual stream barely moves).
INCREMENTS = {"moe_residual": ("x",)}


def check(case: Case, ref: dict, got: dict, inputs: dict) -> None:
    """A backend's outputs against the CPU reference's: same names and shapes, finite, within case.tol."""
    assert ref.keys() == got.keys()
    for name, r in ref.items():
        g = got[name]
        if name in INCREMENTS.get(case.op, ()):
            before = np.asarray(inputs[name], dtype=np.float32).reshape(-1)
            r, g = r - before, g - before
        assert g.shape == r.shape
        assert np.isfinite(g).all(), f"{case.id}/{name}: non-finite values at {np.flatnonzero(~np.isfinite(g))[:8]}"
        err = np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)
        worst = int(np.argmax(np.abs(g - r)))
        assert err <= case.tol, (f"{case.id}/{name}: relative error {err:.2e} > {case.tol:.0e}; worst at flat index "
                                 f"{worst}: got {g[worst]:.6g}, want {r[worst]:.6g}")


def _traffic(c: Case) -> int:
    d = c.dims
    qb = lambda n, k, bits=4, g=64: n * k * bits // 8 + n * (k // g) * 4
    if c.op == "qmm":
        return qb(d["N"], d["K"], d.get("bits", 4), d.get("group", 64)) + 2 * d["T"] * (d["K"] + d["N"])
    if c.op in ("qmm_multi", "rms_norm_qmm"):
        return sum(qb(n, d["K"], d.get("bits", 4)) + 2 * d["T"] * n for n in d["Ns"]) + 4 * d["T"] * d["K"]
    if c.op in ("moe", "moe_residual"):
        k = d["top_k"]
        eb, gb = d.get("bits", 4), d.get("gate_bits", 8)
        routed = min(d["E"], d["T"] * k) * (3 * qb(d["I"], d["H"], eb))
        proj = qb(d["H"], d.get("KO", 2 * d["H"]), d.get("o_bits", 4)) if c.op == "moe_residual" else 0
        return qb(d["E"], d["H"], gb) + routed + 3 * qb(d["IS"], d["H"], eb) + 4 * d["T"] * d["H"] + proj
    if c.op == "attention":
        return 2 * (d["pos0"] + d["T"]) * d["NKV"] * d["HD"] * 2 + d["T"] * d["NH"] * d["HD"] * 8
    if c.op in ("gdn_scan", "gdn_conv_scan_norm"):
        return 2 * d["NV"] * d["DV"] * d["DK"] * 4 + d["T"] * (2 * d["NK"] * d["DK"] + 2 * d["NV"] * d["DV"]) * 2
    if c.op in ("rms_norm", "add_rms_norm"):
        return d["T"] * d["H"] * 10
    if c.op == "embed":
        return d["T"] * (qb(1, d["H"]) + 4 * d["H"])
    C = 2 * d.get("NK", 0) * d.get("DK", 0) + d.get("NV", 0) * d.get("DV", 0)
    return d["T"] * C * 4


def _flops(c: Case) -> int:
    d = c.dims
    if c.op == "qmm":
        return 2 * d["T"] * d["N"] * d["K"]
    if c.op in ("qmm_multi", "rms_norm_qmm"):
        return 2 * d["T"] * d["K"] * sum(d["Ns"])
    if c.op in ("moe", "moe_residual"):
        proj = d["H"] * d.get("KO", 2 * d["H"]) if c.op == "moe_residual" else 0
        return 2 * d["T"] * (d["E"] * d["H"] + 3 * d["top_k"] * d["I"] * d["H"] + 3 * d["IS"] * d["H"] + proj)
    if c.op == "attention":
        keys = d["T"] * d["pos0"] + d["T"] * (d["T"] + 1) // 2
        return 4 * d["NH"] * d["HD"] * keys
    if c.op in ("gdn_scan", "gdn_conv_scan_norm"):
        return 7 * d["T"] * d["NV"] * d["DV"] * d["DK"]
    return 0


REAL = dict(H=2048, NH=16, NKV=2, HD=256, NK=16, NV=32, DK=128, DV=128, E=256, top_k=8, I=512, IS=512)
_gdn_real = {k: REAL[k] for k in ("NK", "NV", "DK", "DV")}
_attn_real = {k: REAL[k] for k in ("NH", "NKV", "HD")}
_moe_real = {k: REAL[k] for k in ("H", "E", "top_k", "I", "IS")}

CASES = [
    Case("embed", dict(T=5, V=248320, H=2048), tags=("model",)),
    Case("embed", dict(T=3, V=491, H=128, bits=8), tags=("edge",)),
    Case("rms_norm", dict(T=1, H=2048), tags=("model",)),
    Case("rms_norm", dict(T=37, H=2048), tags=("model",)),
    Case("rms_norm", dict(T=3, H=192), tags=("edge",)),
    Case("add_rms_norm", dict(T=1, H=2048), tags=("model",)),
    Case("add_rms_norm", dict(T=5, H=320), tags=("edge",)),
    # 4 and 8 float4 chunks per thread
    *[Case(op, dict(T=3, H=h), tags=("edge",)) for op in ("rms_norm", "add_rms_norm") for h in (4000, 6000)],
    # decode GEMV at every real projection shape
    *[Case("qmm", dict(T=1, N=n, K=k, bits=b), tags=("model",)) for n, k, b in (
        (8192, 2048, 4), (4096, 2048, 4), (512, 2048, 4), (32, 2048, 4), (2048, 4096, 4), (256, 2048, 8),
        (1, 2048, 8), (2048, 512, 4))],
    Case("qmm", dict(T=1, N=248320, K=2048, y_f32=True), tags=("model", "slow"), name="qmm-lm_head"),
    Case("qmm", dict(T=4, N=8192, K=2048), tags=("model",)),
    Case("qmm", dict(T=8, N=2048, K=4096), tags=("model",)),
    # the streaming decode GEMV at its other lane counts (1 chunk per lane; 8-bit 2 and 4) and two row units
    Case("qmm", dict(T=1, N=40, K=1024), tags=("edge",)),
    Case("qmm", dict(T=1, N=70, K=1024, bits=8), tags=("edge",)),
    Case("qmm_multi", dict(T=1, K=1024, Ns=(32, 8, 4)), tags=("edge",)),
    Case("qmm_multi", dict(T=1, K=1024, Ns=(30, 8, 2)), tags=("edge",)),  # rows not in whole units: qmv_kernel
    # the GEMV at every token count it takes (1 to 8 rows), 4- and 8-bit
    *[Case("qmm", dict(T=t, N=72, K=256, bits=b), tags=("edge",)) for b in (4, 8) for t in range(2, 9)],
    # the GDN and attention input projections in one launch
    Case("qmm_multi", dict(T=1, K=2048, Ns=(8192, 4096, 32, 32)), tags=("model",)),
    Case("qmm_multi", dict(T=1, K=2048, Ns=(8192, 512, 512)), tags=("model",)),
    Case("qmm_multi", dict(T=3, K=128, Ns=(200, 64, 4, 4)), tags=("edge",)),
    Case("qmm_multi", dict(T=40, K=256, Ns=(96, 64, 8)), tags=("edge",)),
    # the input norm and projections, the final norm and the lm_head (a norm kernel, then the GEMV: the norm inside
    # the streaming GEMV, switch qmv_norm, was removed in session 42), one token and two
    Case("rms_norm_qmm", dict(T=1, K=2048, Ns=(8192, 4096, 32, 32)), tags=("model",)),
    Case("rms_norm_qmm", dict(T=1, K=2048, Ns=(8192, 512, 512)), tags=("model",)),
    Case("rms_norm_qmm", dict(T=1, K=2048, Ns=(248320,), y_f32=True), tags=("model", "slow"), name="rms_norm_qmm-lm_head"),
    Case("rms_norm_qmm", dict(T=1, K=1024, Ns=(70,), bits=8, y_f32=True), tags=("edge",)),
    Case("rms_norm_qmm", dict(T=2, K=256, Ns=(72, 40)), tags=("edge",)),
    # x over a wide range with all-zero chunks, on the streaming GEMV (4 bits: K 1024 or 2048; 8 bits: K ≥ 512)
    *[Case("qmm", dict(T=1, K=k, N=72, bits=b, spread=True), tags=("edge",))
      for b, k in ((4, 1024), (4, 2048), (8, 1024))],
    # ... and on the row-block GEMV (K = 4096 at 4 bits, or short rows), K split over warps or not
    *[Case("qmm", dict(T=1, N=n, K=k, bits=b, spread=True), tags=("edge",)) for n, k, b in (
        (40, 4096, 4), (72, 256, 4), (70, 256, 8), (2048, 4096, 4))],
    # prefill GEMM
    Case("qmm", dict(T=512, N=8192, K=2048), tags=("model",)),
    Case("qmm", dict(T=512, N=2048, K=4096), tags=("model",)),
    Case("qmm", dict(T=256, N=256, K=2048, bits=8, y_f32=True), tags=("model",)),
    Case("qmm", dict(T=9, N=512, K=2048), tags=("model",)),
    # a 14-token prompt tail (switch qmv_mma: the tensor-core GEMV), and its router (8-bit, fp32 logits)
    Case("qmm", dict(T=14, N=8192, K=2048), tags=("model",)),
    Case("qmm", dict(T=16, N=2048, K=4096, y_f32=True), tags=("model",)),
    Case("qmm_multi", dict(T=14, K=2048, Ns=(8192, 4096, 32, 32)), tags=("model",)),
    Case("qmm", dict(T=14, N=256, K=2048, bits=8, y_f32=True), tags=("model",)),
    # the tensor-core GEMV off its tiles: rows off the 16-row block, matrices straddling blocks, 8-bit, group 32, one
    # k-step for two of the 8 warps; K % 64 != 0 goes to the tile GEMMs
    Case("qmm", dict(T=11, N=40, K=128), tags=("edge",)),
    Case("qmm", dict(T=16, N=70, K=192, bits=8, y_f32=True), tags=("edge",)),
    Case("qmm", dict(T=9, N=24, K=256, group=32), tags=("edge",)),
    Case("qmm_multi", dict(T=15, K=256, Ns=(40, 24, 8)), tags=("edge",)),
    Case("qmm", dict(T=10, N=40, K=160, group=32), tags=("edge",)),
    # a prefill chunk's GDN input projections, one GEMM each
    Case("qmm_multi", dict(T=300, K=2048, Ns=(8192, 4096, 32, 32)), tags=("model", "gpu")),
    Case("qmm", dict(T=4096, N=32, K=2048), tags=("model",)),  # the GDN gate projections of a prefill chunk
    # odd shapes: rows and columns off every tile, 8-bit, other group sizes
    Case("qmm", dict(T=3, N=40, K=128), tags=("edge",)),
    Case("qmm", dict(T=77, N=200, K=192), tags=("edge",)),
    Case("qmm", dict(T=130, N=96, K=128, bits=8), tags=("edge",)),
    Case("qmm", dict(T=33, N=65, K=256, group=32), tags=("edge",)),
    Case("qmm", dict(T=2, N=491, K=128, y_f32=True), tags=("edge",)),
    Case("qmm", dict(T=12, N=70, K=128, bits=8), tags=("edge",)),  # the tensor-core GEMV, or (off) the small-tile GEMM
    # the Hopper GEMM (switch wgmma): 128- and 64-token tiles, odd k-steps, a partial last token tile,
    # columns off the 256-row tile, an odd N (no 16-byte output rows), scales loaded (K/group not a multiple of 8)
    Case("qmm", dict(T=513, N=11264, K=128, y_f32=True), tags=("edge",)),
    Case("qmm", dict(T=513, N=11272, K=192), tags=("edge",)),
    Case("qmm", dict(T=70, N=263, K=128), tags=("edge",)),
    # attention: decode at short and long context, prefill from empty and continuing chunks
    Case("attention", dict(T=1, pos0=100, **_attn_real), tags=("model",)),
    Case("attention", dict(T=1, pos0=5000, **_attn_real), tags=("model",)),
    Case("attention", dict(T=1, pos0=40000, **_attn_real), tags=("model", "slow")),
    Case("attention", dict(T=300, pos0=0, **_attn_real), tags=("model",)),
    Case("attention", dict(T=64, pos0=200, **_attn_real), tags=("model",)),
    # one wave of row blocks or more: the prefill kernel unsplit (T·G/128 · NKV ≥ the SMs), many key tiles, from empty
    # and from an unaligned position
    Case("attention", dict(T=2048, pos0=0, **_attn_real), tags=("model", "slow", "gpu")),
    Case("attention", dict(T=1100, pos0=3001, **_attn_real), tags=("model", "slow", "gpu")),
    Case("attention", dict(T=17, pos0=3, NH=4, NKV=2, HD=64), tags=("edge",)),
    Case("attention", dict(T=1, pos0=40, NH=4, NKV=1, HD=32, rotary_dim=8), tags=("edge",)),
    Case("attention", dict(T=130, pos0=0, NH=8, NKV=2, HD=32), tags=("edge",)),
    Case("attention", dict(T=3, pos0=33000, NH=4, NKV=1, HD=32), tags=("edge",)),  # the split path past 32K
    Case("attention", dict(T=20, pos0=500, NH=2, NKV=1, HD=32), tags=("edge",)),   # splits crossing the mask
    # the other head dims, unsplit and split
    Case("attention", dict(T=17, pos0=3, NH=4, NKV=2, HD=128), tags=("edge",)),
    Case("attention", dict(T=2, pos0=600, NH=4, NKV=1, HD=128), tags=("edge",)),
    Case("attention", dict(T=20, pos0=500, NH=2, NKV=1, HD=64), tags=("edge",)),
    # Metal's simdgroup-matrix tiles (attn_simdgroup, ≥ 32 packed rows): split at each head dim, past 32K, an odd G
    # (rows of one token across row blocks), one query head per kv head
    Case("attention", dict(T=16, pos0=3000, **_attn_real), tags=("model",)),
    Case("attention", dict(T=20, pos0=600, NH=4, NKV=1, HD=128), tags=("edge",)),
    Case("attention", dict(T=9, pos0=33000, NH=4, NKV=1, HD=32), tags=("edge",)),
    Case("attention", dict(T=13, pos0=7, NH=6, NKV=2, HD=64), tags=("edge",)),
    Case("attention", dict(T=40, pos0=5, NH=2, NKV=2, HD=128), tags=("edge",)),
    # Metal's decode tile (attn_decode_tile, ≤ 8 packed rows, HD ≥ 64): unsplit and split at HD = 64 and 128
    Case("attention", dict(T=1, pos0=300, NH=8, NKV=2, HD=64), tags=("edge",)),
    Case("attention", dict(T=2, pos0=900, NH=4, NKV=1, HD=64), tags=("edge",)),
    Case("attention", dict(T=1, pos0=50, NH=4, NKV=1, HD=128), tags=("edge",)),
    # a replayed decode step: the kernels must take the position from the device, not the (stale) host value
    Case("attention", dict(T=1, pos0=700, NH=16, NKV=2, HD=256, device_pos=True), tags=("model",)),
    Case("attention", dict(T=1, pos0=40, NH=4, NKV=1, HD=32, device_pos=True), tags=("edge",)),
    # CUDA's attn_kv_early: a decode block whose two early tiles hold the forward's own rows on both sides of a tile
    # edge (positions 5055 and 5056 of split 39, keys 4992-5119)
    Case("attention", dict(T=2, pos0=5055, **_attn_real), tags=("model",)),
    # Gated DeltaNet
    Case("gdn_conv", dict(T=1, **_gdn_real), tags=("model",)),
    Case("gdn_conv", dict(T=300, **_gdn_real), tags=("model",)),
    Case("gdn_conv", dict(T=2, NK=2, NV=4, DK=32, DV=32), tags=("edge",)),
    # 4 channels per thread (conv_dim % 8 == 4), and windows of 2 and 9 taps (the real model has 4)
    Case("gdn_conv", dict(T=70, NK=1, NV=1, DK=32, DV=36), tags=("edge",)),
    *[Case("gdn_conv", dict(T=40, NK=2, NV=4, DK=32, DV=32, conv_kernel=k), tags=("edge",)) for k in (2, 9)],
    Case("gdn_scan", dict(T=1, **_gdn_real), tags=("model",)),
    # one token (the decode step) at odd head counts and widths, a partial block of 32 state rows (DV 48)
    *[Case("gdn_scan", dict(T=1, **d), tags=("edge",)) for d in (dict(NK=4, NV=8, DK=32, DV=64),
                                                                   dict(NK=2, NV=4, DK=64, DV=96),
                                                                   dict(NK=1, NV=2, DK=32, DV=48))],
    Case("gdn_scan", dict(T=64, **_gdn_real), tags=("model",)),
    Case("gdn_scan", dict(T=9, NK=4, NV=8, DK=32, DV=64), tags=("edge",)),
    Case("gdn_scan", dict(T=5, NK=2, NV=2, DK=64, DV=32), tags=("edge",)),
    # the chunked prefill form (64-token chunks, T ≥ 16): around a chunk's end, several chunks, a partial last chunk
    *[Case("gdn_scan", dict(T=t, **_gdn_real), tags=("model",)) for t in (63, 65, 130)],
    Case("gdn_scan", dict(T=40, NK=4, NV=8, DK=32, DV=64), tags=("edge",)),
    Case("gdn_scan", dict(T=200, NK=2, NV=2, DK=64, DV=32), tags=("edge",)),
    # the chunk scan over three row blocks (DV = 96) with a partial last chunk; and 16 chunks of the real shapes
    Case("gdn_scan", dict(T=150, NK=2, NV=4, DK=64, DV=96), tags=("edge",)),
    Case("gdn_scan", dict(T=1000, **_gdn_real), tags=("model",)),
    # a decode token's conv, scan and gated norm (one kernel: on CUDA a block per head, a cluster per key head; on Metal
    # a threadgroup per key head) at the real and odd shapes; a window of 3 and three value heads per key head (CUDA:
    # the conv apart, the scan and norm in one kernel); DV = 144 (CUDA: the three apart; Metal: the conv apart, 288
    # rows per key head being more than its one-token kernel holds); a prompt of 3 (the three ops apart)
    Case("gdn_conv_scan_norm", dict(T=1, **_gdn_real), tags=("model",)),
    *[Case("gdn_conv_scan_norm", dict(T=1, **d), tags=("edge",)) for d in (dict(NK=4, NV=8, DK=32, DV=64),
                                                                             dict(NK=2, NV=4, DK=64, DV=96),
                                                                             dict(NK=1, NV=2, DK=32, DV=48),
                                                                             dict(NK=2, NV=4, DK=64, DV=64,
                                                                                  conv_kernel=3),
                                                                             dict(NK=1, NV=3, DK=32, DV=32),
                                                                             dict(NK=1, NV=2, DK=32, DV=144))],
    Case("gdn_conv_scan_norm", dict(T=3, NK=2, NV=4, DK=64, DV=32), tags=("edge",)),
    Case("gdn_norm", dict(T=1, **_gdn_real), tags=("model",)),
    Case("gdn_norm", dict(T=300, **_gdn_real), tags=("model",)),
    Case("gdn_norm", dict(T=33, NK=2, NV=4, DK=32, DV=64), tags=("edge",)),
    # MoE: decode, prefill, odd geometries, and routing skewed onto the same experts (1, 2, 127 rows each)
    Case("moe", dict(T=1, **_moe_real), tags=("model", "slow")),
    Case("moe", dict(T=64, **_moe_real), tags=("model", "slow")),
    Case("moe", dict(T=4096, **_moe_real), tags=("model", "slow", "gpu")),  # a prefill chunk: ~128 rows per expert
    # a 14-token prompt tail (the server's assistant header) and other T past the decode kernels' 8
    Case("moe", dict(T=14, **_moe_real), tags=("model", "slow", "gpu")),
    # ≤ 16 tokens at small shapes (every expert ≤ 16 rows: the Hopper kernel's 16-row tile, switch moe_tiles_16):
    # experts of 1 to 4 rows; group 32 and 8-bit experts on the mma.sync tile GEMM
    Case("moe", dict(T=13, H=256, E=12, top_k=3, I=128, IS=64), tags=("edge",)),
    Case("moe", dict(T=15, H=192, E=10, top_k=4, I=96, IS=64, group=32), tags=("edge",)),
    Case("moe", dict(T=9, H=256, E=6, top_k=2, I=64, IS=64, group=32, bits=8, gate_bits=4), tags=("edge",)),
    Case("moe", dict(T=16, H=128, E=16, top_k=4, I=64, IS=64), tags=("edge",)),
    Case("moe_residual", dict(T=11, H=64, E=8, top_k=2, I=64, IS=128), tags=("edge",)),
    Case("moe", dict(T=5, H=64, E=8, top_k=2, I=64, IS=128), tags=("edge",)),
    Case("moe", dict(T=127, H=128, E=16, top_k=4, I=64, IS=64), tags=("edge",)),
    Case("moe", dict(T=300, H=256, E=12, top_k=3, I=128, IS=64), tags=("edge",)),
    *[Case("moe", dict(T=t, H=128, E=8, top_k=2, I=64, IS=64, skewed=True), tags=("edge",)) for t in (1, 2, 127)],
    # exact ties between the router's logits, across a CUDA warp's lanes and within one: the lower id goes first
    *[Case("moe", dict(T=1, H=128, E=64, top_k=8, I=64, IS=64, skewed=True, tied=t), tags=("edge",))
      for t in ("lanes", "pairs")],
    # the rest of a layer after its mixer: the output projection, the residual, the post-mixer norm, the MoE, the
    # residual (decode, switch norm_fold: the projection adds into x, the norm folded into the router's GEMV where the
    # streaming kernel takes it)
    Case("moe_residual", dict(T=1, KO=4096, **_moe_real), tags=("model", "slow")),
    Case("moe_residual", dict(T=1, H=128, E=16, top_k=4, I=64, IS=64), tags=("edge",)),
    # one token whose router (8-bit, then 4-bit) the streaming decode GEMV takes
    Case("moe_residual", dict(T=1, H=512, E=16, top_k=4, I=128, IS=128), tags=("edge",)),
    Case("moe_residual", dict(T=1, H=1024, E=8, top_k=2, I=64, IS=64, gate_bits=4, KO=384), tags=("edge",)),
    Case("moe_residual", dict(T=3, H=64, E=8, top_k=2, I=64, IS=128), tags=("edge",)),
    Case("moe_residual", dict(T=130, H=128, E=16, top_k=4, I=64, IS=64), tags=("edge",)),
    Case("moe_residual", dict(T=1, H=128, E=8, top_k=2, I=64, IS=64, bits=8, gate_bits=4, o_bits=8), tags=("edge",)),
    # the most experts per token both GPU backends take (backend/checks.h: top_k ≤ min(E, 32)): decode and prefill
    *[Case("moe", dict(T=t, H=64, E=40, top_k=32, I=64, IS=64), tags=("edge",)) for t in (3, 20)],
    # 100 rows per expert: the 128-row expert tiles (switch moe_tiles_128)
    Case("moe", dict(T=200, H=128, E=4, top_k=2, I=64, IS=64), tags=("edge",)),
    # the Hopper expert GEMM (H, I ≥ 256) at each of its token tiles: 6, 20, 50 rows per expert (16-, 32-, 64-token
    # tiles) and 150 (a 128-token tile and a partial one)
    *[Case("moe", dict(T=t, H=256, E=4, top_k=2, I=256, IS=64), tags=("edge",)) for t in (12, 40, 100, 300)],
    # 150 rows per expert: two row tiles, the second partial; odd k-steps (H = I = 192)
    Case("moe", dict(T=300, H=128, E=4, top_k=2, I=64, IS=64), tags=("edge",)),
    Case("moe", dict(T=300, H=192, E=4, top_k=2, I=192, IS=64), tags=("edge",)),
    # 8-bit experts with a 4-bit router and shared gate: decode, and prefill with 10 and 40 rows per expert
    *[Case("moe", dict(T=t, H=128, E=8, top_k=2, I=64, IS=64, bits=8, gate_bits=4), tags=("edge",))
      for t in (3, 40, 160)],
]
assert len({c.id for c in CASES}) == len(CASES), "two op cases share an id"
