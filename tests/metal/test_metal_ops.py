"""Every op case of tests/ops/cases.py on the Metal kernels, executed by the CPU harness, against the CPU reference
backend, with the tolerance check of the CUDA op test (tests/ops/cases.py: check).

Every case runs in forward, reverse and random thread order (conftest.py: thread_order), and once more (forward) in
the ASan/UBSan build (test_asan.py). A kernel that does not exist yet fails its cases with "Metal kernel '<name>' is not
implemented"; a kernel that no case dispatches fails test_every_kernel_runs_in_an_op_case.
"""
import secrets

import numpy as np
import pytest

from ops.cases import CASES, check, make

# Kernels that the op table does not reach, and the test that runs them instead.
ELSEWHERE = {"sample": "tests/metal/test_metal_sample.py (token selection in the decode loop)"}
DISPATCHED: set[str] = set()  # kernels the op cases of this session dispatched
PASSED: set[str] = set()      # the cases that passed in this session (in some order)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_op_matches_cpu(core, monkeypatch, case, thread_order):
    seed = secrets.randbits(63)
    print(f"rng seed and LILY_METAL_SEED: {seed}")
    monkeypatch.setenv("LILY_METAL_ORDER", thread_order)
    monkeypatch.setenv("LILY_METAL_SEED", str(seed))
    params, inputs = make(case, np.random.default_rng(seed))
    ref = core.testing.run_op("cpu", case.op, params, inputs)
    before = core.testing.metal_kernels()
    got = core.testing.run_op("metal", case.op, params, inputs)
    DISPATCHED.update(name for name, n in core.testing.metal_kernels().items() if n > before[name])
    check(case, ref, got, inputs)
    PASSED.add(case.id)


def test_every_kernel_runs_in_an_op_case(core):
    """Every kernel of metal/*.metal (each template instance: bits, tile rows, head dim, rows per GEMV, chunks per
    thread) is dispatched by some op case, so the thread orders and the ASan run cover all of them."""
    cases = {c.id for c in CASES}
    if PASSED != cases:
        pytest.skip(f"needs every op case in this session ({len(PASSED)} of {len(cases)} ran and passed)")
    missing = set(core.testing.metal_kernels()) - DISPATCHED - set(ELSEWHERE)
    assert not missing, f"kernels no op case dispatches: {sorted(missing)}; add cases to tests/ops/cases.py"
    assert not set(ELSEWHERE) & DISPATCHED, "ELSEWHERE lists a kernel the op cases reach"
