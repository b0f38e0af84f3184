"""Tier 1 op test (llama.cpp's test-backend-ops idea): every op of every GPU backend compiled in, against the CPU
reference backend, on identical fresh random inputs, at the real shapes and at odd ones (tests/ops/cases.py)."""
import dataclasses
import os

import numpy as np
import pytest

import lily
from lily import _core

from .cases import CASES, Case, check, make

GPU_BACKENDS = [b for b in lily.backend_names() if b != "cpu"]
# LILY_OP_TAGS=edge runs only the cases with that tag (the small ones, e.g. under compute-sanitizer).
SELECTED = [c for c in CASES if os.environ.get("LILY_OP_TAGS", "") in ("", *c.tags)]
# Every case runs with every optimisation on (the default) and with all of them off (the plain path).
ALL_OFF = ",".join(name for name, _, _ in _core.optimisations())


@pytest.fixture(scope="module", params=GPU_BACKENDS or [pytest.param(None, marks=pytest.mark.skip(
    reason="no GPU backend compiled into this build"))])
def backend(request):
    info = next(b for b in lily.backends() if b.name == request.param)
    if not info.usable:
        pytest.skip(f"{request.param} backend compiled in but it cannot run here: {info.reason}")
    return request.param


@pytest.mark.parametrize("switches", ["on", "off"])
@pytest.mark.parametrize("case", SELECTED, ids=lambda c: c.id)
def test_op_matches_cpu(backend, case, switches):
    rng = np.random.default_rng()
    params, inputs = make(case, rng)
    ref = _core.testing.run_op("cpu", case.op, params, inputs)
    got = _core.testing.run_op(backend, case.op, {**params, "disable": ALL_OFF if switches == "off" else ""}, inputs)
    check(case, ref, got, inputs)


# Decode MoE switches that must keep the bits (the gate+up kernel's own routing, switch route_fused):
# - route_logits picks the top-k on the logits instead of the probabilities. The softmax keeps their order, so the
#   experts and weights, and with them the output, are those of the rounds over the probabilities (fresh random
#   logits: no two round to one probability).
# - moe_down_early hands the down kernel the expert ids before its PDL wait: the same arithmetic in the same order.
# And decode attention's attn_kv_early: the cached rows before the position copied before the PDL wait, the position's
# own rows after it, into the same tiles (the decode instance: T·G ≤ 16 packed rows per kv head).
# (Metal: tests/metal/test_metal_ops.py, on the CPU harness, for route_logits.)
ROUTED = [c for c in SELECTED if c.op in ("moe", "moe_residual") and c.dims["T"] == 1]
SAME_BITS = [(c, s) for s in ("route_logits", "moe_down_early") for c in ROUTED] + \
            [(c, "moe_down_early") for c in SELECTED if c.op in ("moe", "moe_residual") and 1 < c.dims["T"] <= 8] + \
            [(c, "attn_kv_early") for c in SELECTED
             if c.op == "attention" and c.dims["T"] * c.dims["NH"] // c.dims["NKV"] <= 16]
CUDA = next((b for b in lily.backends() if b.name == "cuda"), None)


@pytest.mark.skipif(CUDA is None or not CUDA.usable,
                    reason=f"the CUDA backend cannot run here: {CUDA.reason if CUDA else 'not compiled in'}")
@pytest.mark.parametrize("case,switch", SAME_BITS, ids=lambda v: v.id if isinstance(v, Case) else v)
def test_switch_keeps_the_bits(case, switch):
    params, inputs = make(case, np.random.default_rng())
    on = _core.testing.run_op("cuda", case.op, {**params, "disable": ""}, inputs)
    off = _core.testing.run_op("cuda", case.op, {**params, "disable": switch}, inputs)
    for name, v in on.items():
        np.testing.assert_array_equal(v, off[name], err_msg=f"{case.id}/{switch}/{name}")


# The switches qmv_dp4a and moe_dp4a stage x in 16-bit fixed point per 16-byte code chunk (csrc/backend/cuda/x16.cuh):
# exact for every element within 2^7 of its chunk's largest, the rest off by ≤ 2^-15 of it, and integer sums. Their
# results must agree with the fp32 path's far closer than the op test's bf16 tolerance: ≤ 5e-4 relative, fp32 outputs
# (a dropped low byte would be ~4e-3). The one-token GEMV cases with fp32 outputs, and the one-token MoE's increment.
DP4A = [(c, "qmv_dp4a") for c in SELECTED if c.op == "qmm" and c.dims["T"] == 1] + \
       [(c, "qmv_dp4a") for c in SELECTED if c.op == "rms_norm_qmm" and c.dims["T"] == 1 and len(c.dims["Ns"]) == 1] + \
       [(c, "moe_dp4a") for c in SELECTED if c.op == "moe_residual" and c.dims["T"] == 1]


@pytest.mark.skipif(CUDA is None or not CUDA.usable,
                    reason=f"the CUDA backend cannot run here: {CUDA.reason if CUDA else 'not compiled in'}")
@pytest.mark.parametrize("case,switch", DP4A, ids=lambda v: v.id if isinstance(v, Case) else v)
def test_dp4a_matches_the_fp32_path(case, switch):
    params, inputs = make(case, np.random.default_rng())
    if case.op != "moe_residual":
        params["y_f32"] = True
    on = _core.testing.run_op("cuda", case.op, {**params, "disable": ""}, inputs)
    off = _core.testing.run_op("cuda", case.op, {**params, "disable": switch}, inputs)
    check(dataclasses.replace(case, tol=5e-4), off, on, inputs)
