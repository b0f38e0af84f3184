"""Every op case of tests/ops/cases.py on the Metal kernels, executed by the CPU harness, against the CPU reference
backend, with the tolerance check of the CUDA op test (tests/ops/cases.py: check).

Every case but those tagged "gpu" runs in forward, reverse and random thread order (conftest.py: thread_order), and
once more (forward) in the ASan/UBSan build (test_asan.py). The cases where a Metal launcher reads an ablation switch
(core/optimisations.h) run a second time with every switch off, the plain path the switch falls back to (as the CUDA
op test does for every case). A kernel that does not exist yet fails its cases with "Metal kernel '<name>' is not
implemented"; a kernel that no case dispatches fails test_every_kernel_runs_in_an_op_case.
"""
import secrets

import numpy as np
import pytest

from ops.cases import CASES as ALL_CASES
from ops.cases import check, make

# The cases sized for the GPU kernels' tiles (tag "gpu"): minutes each on the harness, no kernel the others miss.
CASES = [c for c in ALL_CASES if "gpu" not in c.tags]

# Kernels that the op table does not reach, and the test that runs them instead.
ELSEWHERE = {k: "tests/metal/test_metal_sample.py (token selection in the decode loop and directly)"
             for k in ("sample", "sample_part", "sample_merge")}
DISPATCHED: set[str] = set()  # kernels the op cases of this session dispatched
PASSED: set[str] = set()      # the cases that passed in this session (in some order), "<id>" or "<id>/off"
KERNELS_ON: dict[str, set[str]] = {}  # case id: the kernels its run with every switch on dispatched


def _switched(case) -> bool:
    """Whether a Metal switch changes this case's path: the chunked GDN prefill (gdn_chunked, T ≥ 16, policy.h), a
    decode token's GDN layer in one kernel (gdn_prep_fused, gdn_norm_fused, gdn_conv_fused; policy.h: gdn_token_path),
    and every MoE case: the one-threadgroup sort of the prefill path (moe_sort_scan) or, where the decode kernels take
    the case (T ≤ kQmvMaxT = 8), the routing inside moe_gate_up (route_fused), and attention from ATTN_SG_MIN_ROWS = 32
    packed rows per kv head (T·G: attn_simdgroup) or up to ATTN_DECODE_BM = 8 of them at HD ≥ 64 (attn_decode_tile).
    test_op_matches_cpu_switches_off fails if a case listed here dispatches the same kernels in both positions."""
    if case.op == "attention":
        rows = case.dims["T"] * (case.dims["NH"] // case.dims["NKV"])
        return rows >= 32 or (rows <= 8 and case.dims["HD"] >= 64)
    if case.op == "gdn_scan":
        return case.dims["T"] >= 16
    if case.op == "gdn_conv_scan_norm":
        return case.dims["T"] == 1
    return case.op in ("moe", "moe_residual")


OFF_CASES = [c for c in CASES if _switched(c)]
# A decode token's GDN layer with gdn_conv_fused alone off: the conv dispatch, then the scan and norm in one kernel.
NOCONV_CASES = [c for c in CASES if c.op == "gdn_conv_scan_norm" and c.dims["T"] == 1]


def _run(core, monkeypatch, case, thread_order, disable: str) -> set[str]:
    """Runs the case on the CPU and on the Metal kernels (with the switches `disable` off), checks the outputs, and
    returns the kernels the Metal run dispatched."""
    seed = secrets.randbits(63)
    print(f"rng seed and LILY_METAL_SEED: {seed}")
    monkeypatch.setenv("LILY_METAL_ORDER", thread_order)
    monkeypatch.setenv("LILY_METAL_SEED", str(seed))
    params, inputs = make(case, np.random.default_rng(seed))
    ref = core.testing.run_op("cpu", case.op, params, inputs)
    before = core.testing.metal_kernels()
    got = core.testing.run_op("metal", case.op, {**params, "disable": disable}, inputs)
    kernels = {name for name, n in core.testing.metal_kernels().items() if n > before[name]}
    DISPATCHED.update(kernels)
    check(case, ref, got, inputs)
    return kernels


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_cpu(core, monkeypatch, case, thread_order):
    KERNELS_ON[case.id] = _run(core, monkeypatch, case, thread_order, "")
    PASSED.add(case.id)


@pytest.mark.parametrize("case", OFF_CASES, ids=[c.id for c in OFF_CASES])
def test_op_matches_cpu_switches_off(core, monkeypatch, case, thread_order):
    all_off = ",".join(name for name, _, _ in core.optimisations())
    kernels = _run(core, monkeypatch, case, thread_order, all_off)
    if case.id in KERNELS_ON:
        assert kernels != KERNELS_ON[case.id], f"{case.id}: no switch changes its kernels ({sorted(kernels)})"
    PASSED.add(f"{case.id}/off")


@pytest.mark.parametrize("case", NOCONV_CASES, ids=[c.id for c in NOCONV_CASES])
def test_op_matches_cpu_conv_apart(core, monkeypatch, case, thread_order):
    kernels = _run(core, monkeypatch, case, thread_order, "gdn_conv_fused")
    assert "gdn_conv" in kernels and not any(k.startswith("gdn_conv_token") for k in kernels), sorted(kernels)
    PASSED.add(f"{case.id}/noconv")


def test_every_kernel_runs_in_an_op_case(core):
    """Every kernel of metal/*.metal (each template instance: bits, tile rows, head dim, rows per GEMV, chunks per
    thread), of the optimised paths and of the plain paths their switches fall back to, is dispatched by some op case,
    so the thread orders and the ASan run cover all of them."""
    cases = {c.id for c in CASES} | {f"{c.id}/off" for c in OFF_CASES} | {f"{c.id}/noconv" for c in NOCONV_CASES}
    if PASSED != cases:
        pytest.skip(f"needs every op case in this session ({len(PASSED)} of {len(cases)} ran and passed)")
    missing = set(core.testing.metal_kernels()) - DISPATCHED - set(ELSEWHERE)
    assert not missing, f"kernels no op case dispatches: {sorted(missing)}; add cases to tests/ops/cases.py"
    assert not set(ELSEWHERE) & DISPATCHED, "ELSEWHERE lists a kernel the op cases reach"


# One decode token's MoE with the routing inside moe_gate_up (route_fused): route_logits picks the top-k on the logits
# instead of the probabilities, which the softmax keeps in order, so the output is bit for bit the switch-off one
# (fresh random logits: no two round to one probability).
ROUTED = [c for c in CASES if c.op in ("moe", "moe_residual") and c.dims["T"] <= 8 and "slow" not in c.tags]


@pytest.mark.parametrize("case", ROUTED, ids=[c.id for c in ROUTED])
def test_route_logits_picks_as_the_probabilities(core, monkeypatch, case):
    seed = secrets.randbits(63)
    print(f"rng seed and LILY_METAL_SEED: {seed}")
    monkeypatch.setenv("LILY_METAL_SEED", str(seed))
    params, inputs = make(case, np.random.default_rng(seed))
    on = core.testing.run_op("metal", case.op, {**params, "disable": ""}, inputs)
    off = core.testing.run_op("metal", case.op, {**params, "disable": "route_logits"}, inputs)
    for name, v in on.items():
        np.testing.assert_array_equal(v, off[name], err_msg=f"{case.id}/{name}")
