"""Every op case of tests/ops/cases.py on the Metal kernels, executed by the CPU harness, against the CPU reference
backend, with the tolerance logic of tests/ops/test_ops.py.

Thread orders: every case in forward, reverse and random order, except the prefill GEMMs above 1 GFLOP (forward
only: ~25 s of fibers each extra order); every case up to 0.1 GFLOP and every "edge" case once more (forward) in the
ASan/UBSan build. One case is left to GPU runs unless LILY_METAL_FULL=1 (HARNESS_TOO_SLOW). A kernel that does not
exist yet fails its cases with "Metal kernel '<name>' is not implemented".
"""
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

from ops.cases import CASES, check, make

# Set in the ASan subprocess (test_edge_cases_under_asan): the edge cases and the small model-shape ones, forward.
ASAN_CHILD = "LILY_METAL_ASAN_CHILD"
FULL = os.environ.get("LILY_METAL_FULL") == "1"
# Cases whose fibers take too long on the CPU for CI: {case id: why}. The same kernels run at smaller shapes.
HARNESS_TOO_SLOW = {"moe-T64-H2048-E256-top_k8-I512-IS512": "about 13 minutes in the harness on one core"}


def _runs():
    child = bool(os.environ.get(ASAN_CHILD))
    for case in CASES:
        edge = "edge" in case.tags
        if child and not (edge or case.flops() <= 1e8):
            continue
        if case.id in HARNESS_TOO_SLOW and not FULL:
            reason = f"{HARNESS_TOO_SLOW[case.id]}: too slow for the CPU harness in CI (LILY_METAL_FULL=1 runs it)"
            yield pytest.param("forward", case, id=f"forward-{case.id}", marks=pytest.mark.skip(reason=reason))
            continue
        all_orders = not child and (edge or case.flops() <= 1e9)
        for order in ("forward", "reverse", "random") if all_orders else ("forward",):
            yield pytest.param(order, case, id=f"{order}-{case.id}")


@pytest.mark.parametrize("order, case", list(_runs()))
def test_op_matches_cpu(core, monkeypatch, order, case):
    seed = secrets.randbits(63)
    print(f"rng seed and LILY_METAL_SEED: {seed}")
    monkeypatch.setenv("LILY_METAL_ORDER", order)
    monkeypatch.setenv("LILY_METAL_SEED", str(seed))
    params, inputs = make(case, np.random.default_rng(seed))
    ref = core.testing.run_op("cpu", case.op, params, inputs)
    got = core.testing.run_op("metal", case.op, params, inputs)
    check(case, ref, got)


@pytest.mark.skipif(bool(os.environ.get(ASAN_CHILD)), reason="already in the ASan subprocess")
def test_edge_cases_under_asan(asan_env):
    """The edge cases in the ASan/UBSan build: any out-of-bounds access or undefined behaviour aborts the run."""
    env = dict(asan_env, **{ASAN_CHILD: "1"})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                        "-k", "test_op_matches_cpu"], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, f"edge cases under ASan/UBSan (rc {r.returncode}):\n{(r.stdout + r.stderr)[-12000:]}"
