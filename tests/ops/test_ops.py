"""Tier 1 op test (llama.cpp's test-backend-ops idea): every op of every GPU backend compiled in, against the CPU
reference backend, on identical fresh random inputs, at the real shapes and at odd ones (tests/ops/cases.py)."""
import os

import numpy as np
import pytest

import lily
from lily import _core

from .cases import CASES, check, make

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
