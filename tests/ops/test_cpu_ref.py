"""Tier 0 op test: the CPU reference backend against float64 NumPy, for the ops whose CPU loops are blocked (qmm's
16-row weight tiles and 4-token steps, the MoE grouped by expert in 512-token blocks, attention over 16 query rows,
the GDN state's 16-row lanes), at shapes that leave a tail in every block: odd token counts, row counts that are not
multiples of 16, head sizes that are not multiples of 16 or 4, GQA groups that do not divide 16, experts with no
tokens and a block boundary inside the MoE."""
import numpy as np
import pytest

from lily import _core

from .cases import Case, dequantize, make

CASES = [
    *[Case("qmm", dict(T=t, N=n, K=k, bits=b, group=g)) for t, n, k, b, g in (
        (1, 1, 64, 8, 64), (3, 17, 128, 4, 32), (7, 40, 256, 4, 128), (33, 15, 192, 8, 32), (130, 70, 128, 4, 64))],
    Case("attention", dict(T=7, pos0=0, NH=6, NKV=2, HD=42, rotary_dim=10)),   # G = 3; HD % 4 = 2
    Case("attention", dict(T=1, pos0=37, NH=6, NKV=2, HD=42, rotary_dim=10)),  # decode
    Case("attention", dict(T=19, pos0=5, NH=8, NKV=1, HD=32)),                 # G = 8: 152 query rows
    Case("attention", dict(T=33, pos0=100, NH=4, NKV=4, HD=64)),               # G = 1
    Case("gdn_scan", dict(T=5, NK=2, NV=6, DK=24, DV=20)),                     # DV padded to 32 lanes
    Case("gdn_scan", dict(T=1, NK=1, NV=1, DK=16, DV=16)),
    Case("gdn_scan", dict(T=9, NK=2, NV=4, DK=32, DV=64)),
    Case("moe", dict(T=1, H=64, E=16, top_k=4, I=64, IS=128)),                # 12 experts without a token
    Case("moe", dict(T=37, H=128, E=6, top_k=3, I=64, IS=64)),
    Case("moe", dict(T=520, H=64, E=5, top_k=2, I=128, IS=64)),               # two token blocks (512 + 8)
]


def _q(x: dict, name: str, bits: int = 4, group: int = 64) -> np.ndarray:
    w, s, b = x[f"{name}.w"], x[f"{name}.scales"], x[f"{name}.biases"]
    if w.ndim == 3:  # an expert stack
        return np.stack([dequantize(w[e], s[e], b[e], bits, group) for e in range(w.shape[0])])
    return dequantize(w, s, b, bits, group)


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _rms(v, w, eps):
    return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * w


def ref_qmm(p, x):
    return {"y": x["x"].astype(np.float64) @ _q(x, "W", p.get("bits", 4), p.get("group", 64)).T}


def scale_qmm(p, x):  # Σ|x·w| per output: a single dot (N = T = 1) can cancel far below its terms
    return {"y": np.abs(x["x"].astype(np.float64)) @ np.abs(_q(x, "W", p.get("bits", 4), p.get("group", 64))).T}


def ref_attention(p, x):
    T, NH, NKV, HD, pos0, R = p["T"], p["NH"], p["NKV"], p["HD"], p["pos0"], p["rotary_dim"]
    qg = x["qg"].astype(np.float64).reshape(T, NH, 2 * HD)
    pos = (pos0 + np.arange(T))[:, None, None]
    half = R // 2
    angle = pos * p["rope_theta"] ** (-2.0 * np.arange(half) / R)

    def rope(v):
        v = v.copy()
        v0, v1 = v[..., :half].copy(), v[..., half:R].copy()
        v[..., :half], v[..., half:R] = v0 * np.cos(angle) - v1 * np.sin(angle), v1 * np.cos(angle) + v0 * np.sin(angle)
        return v

    q = rope(_rms(qg[..., :HD], x["q_norm"], p["eps"]))
    k = rope(_rms(x["k"].astype(np.float64).reshape(T, NKV, HD), x["k_norm"], p["eps"]))
    kc, vc = x["k_cache"].astype(np.float64).copy(), x["v_cache"].astype(np.float64).copy()
    kc[pos0:pos0 + T], vc[pos0:pos0 + T] = k, x["v"].reshape(T, NKV, HD)
    kv = np.arange(NH) // (NH // NKV)
    s = np.einsum("thd,jhd->thj", q, kc[:pos0 + T][:, kv]) / np.sqrt(HD)
    s = np.where(np.arange(pos0 + T) > pos, -np.inf, s)  # causal: token t sees keys 0 .. pos0 + t
    prob = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("thj,jhd->thd", prob / prob.sum(-1, keepdims=True), vc[:pos0 + T][:, kv])
    return {"out": o * _sigmoid(qg[..., HD:]), "k_cache": kc, "v_cache": vc}


def ref_gdn_scan(p, x):
    T, NK, NV, DK, DV = p["T"], p["NK"], p["NV"], p["DK"], p["DV"]
    c = x["c"].astype(np.float64)
    S = x["state"].astype(np.float64).copy()
    kh = np.arange(NV) // (NV // NK)
    y = np.empty((T, NV, DV))
    for t in range(T):
        q, k = c[t, :NK * DK].reshape(NK, DK)[kh], c[t, NK * DK:2 * NK * DK].reshape(NK, DK)[kh]
        v = c[t, 2 * NK * DK:].reshape(NV, DV)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(DK)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        beta = _sigmoid(x["b"][t].astype(np.float64))
        z = x["alpha"][t].astype(np.float64) + x["dt_bias"]
        g = np.exp(-np.exp(x["A_log"].astype(np.float64)) * (np.maximum(z, 0) + np.log1p(np.exp(-np.abs(z)))))
        S *= g[:, None, None]
        delta = beta[:, None] * (v - np.einsum("hij,hj->hi", S, k))
        S += delta[:, :, None] * k[:, None, :]
        y[t] = np.einsum("hij,hj->hi", S, q)
    return {"y": y, "state": S}


def ref_moe(p, x):
    m, K = x["m"].astype(np.float64), p["top_k"]
    logits = m @ _q(x, "router", 8).T
    prob = np.exp(logits - logits.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    top = np.argsort(-prob, axis=-1, kind="stable")[:, :K]
    gate, up, down = _q(x, "gate"), _q(x, "up"), _q(x, "down")

    def swiglu(g, u, d, v):
        a = v @ g.T
        return (a * _sigmoid(a) * (v @ u.T)) @ d.T

    out = swiglu(_q(x, "shared_gate"), _q(x, "shared_up"), _q(x, "shared_down"), m)
    out *= _sigmoid(m @ _q(x, "shared_expert_gate", 8).T)
    for t in range(len(m)):
        w = prob[t, top[t]] / prob[t, top[t]].sum()
        for e, we in zip(top[t], w):
            out[t] += we * swiglu(gate[e], up[e], down[e], m[t])
    return {"out": out}


REFS = {"qmm": ref_qmm, "attention": ref_attention, "gdn_scan": ref_gdn_scan, "moe": ref_moe}
# What an output's error is measured against, where the outputs' own largest magnitude is not the scale of the fp32
# sums behind them (default: max|ref|).
SCALES = {"qmm": scale_qmm}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_cpu_op_matches_float64(case):
    params, inputs = make(case, np.random.default_rng())
    got = _core.testing.run_op("cpu", case.op, params, inputs)
    scales = SCALES[case.op](params, inputs) if case.op in SCALES else {}
    for name, want in REFS[case.op](params, inputs).items():
        g = got[name].reshape(want.shape)
        err = np.abs(g - want).max() / np.abs(scales.get(name, want)).max()
        assert err < 1e-5, f"{case.id}/{name}: max|Δ| / max|scale| = {err:.2e}"


@pytest.mark.parametrize("cols", [0, 3])
def test_run_op_names_a_quantized_input_without_a_group_size(cols):
    """A matrix whose scales give no whole group size (none per row, or K not a multiple of their count) is refused
    with its name, not divided by."""
    params, inputs = make(Case("qmm", dict(T=1, N=4, K=64)), np.random.default_rng())
    inputs["W.scales"] = inputs["W.scales"][:, :1].repeat(cols, axis=1)
    with pytest.raises(ValueError, match="run_op: W has K=64"):
        _core.testing.run_op("cpu", "qmm", params, inputs)
