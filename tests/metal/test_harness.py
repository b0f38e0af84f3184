"""Each feature of the Metal CPU harness catches what it claims to catch: one small kernel with one deliberate bug
per feature (tests/metal/harness/broken/*.metal), run by the harness's driver `metal_emu_run`, and correct kernels
that pass in every thread order and under ASan."""
import os
import re
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BROKEN = Path(__file__).resolve().parent / "harness" / "broken"
REWRITE = Path(__file__).resolve().parent / "harness" / "rewrite.py"
ORDERS = ("forward", "reverse", "random")


def line_of(file: str, text: str) -> str:
    """'tests/metal/harness/broken/<file>:<line>' of the first line of the file containing `text`."""
    lines = (BROKEN / file).read_text().splitlines()
    return f"tests/metal/harness/broken/{file}:{next(i + 1 for i, s in enumerate(lines) if text in s)}"


def run(build: Path, kernel: str, inputs: np.ndarray, groups: int, threads: int, n_out: int, order="forward",
        env=None) -> subprocess.CompletedProcess:
    seed = secrets.randbits(63)
    cmd = [str(build / "metal_emu_run"), kernel, order, str(seed), str(groups), str(threads), str(n_out)]
    print(" ".join(cmd))
    return subprocess.run(cmd, input=" ".join(f"{v:.9g}" for v in inputs), capture_output=True, text=True, env=env,
                          timeout=60)


def values(r: subprocess.CompletedProcess) -> np.ndarray:
    assert r.returncode == 0, r.stderr
    return np.array([float(v) for v in r.stdout.split()], np.float32)


def expected_reverse(x: np.ndarray) -> np.ndarray:
    g = x.reshape(-1, 64)
    sums = np.repeat(g.reshape(-1, 2, 32).sum(axis=2, dtype=np.float64), 32, axis=1)
    return (g[:, ::-1] + sums + g[:, np.arange(64) ^ 1]).reshape(-1)


@pytest.fixture
def x(rng) -> np.ndarray:
    return rng.normal(0, 1, 128).astype(np.float32)


@pytest.fixture(scope="session")
def asan_driver_env(asan_env) -> dict:
    """The ASan driver is an executable with its own runtime: no preload."""
    return {k: v for k, v in asan_env.items() if k != "LD_PRELOAD"}


@pytest.mark.parametrize("order", ORDERS)
def test_correct_kernels_pass(emu_build, x, order):
    np.testing.assert_allclose(values(run(emu_build, "correct_reverse", x, 2, 64, 128, order)), expected_reverse(x),
                               rtol=1e-5, atol=1e-5)
    a, b = x[:64].reshape(8, 8), x[64:].reshape(8, 8)
    np.testing.assert_allclose(values(run(emu_build, "correct_matmul", x, 1, 32, 64, order)),
                               (a.astype(np.float64) @ b).reshape(-1), rtol=1e-5, atol=1e-5)


def test_correct_kernels_pass_under_asan(asan_build, asan_driver_env, x):
    got = values(run(asan_build, "correct_reverse", x, 2, 64, 128, "random", asan_driver_env))
    np.testing.assert_allclose(got, expected_reverse(x), rtol=1e-5, atol=1e-5)


def test_missing_barrier_shows_under_some_order(emu_build, x):
    """Without the barrier a thread can read a slot before its owner writes it: poisoned memory comes back as NaN."""
    want = x.reshape(-1, 64)[:, ::-1].reshape(-1)
    wrong = [order for order in ORDERS if not np.array_equal(values(run(emu_build, "missing_barrier", x, 2, 64, 128,
                                                                        order)), want)]
    assert wrong, "the race of missing_barrier went unnoticed in every order"


def test_early_return_before_barrier(emu_build, x):
    r = run(emu_build, "early_return", x[:100], 2, 64, 128)  # group 1 has 36 live threads out of 64
    assert r.returncode == 1
    assert "early return before a barrier" in r.stderr
    assert f"threads 0-35 wait at threadgroup_barrier ({line_of('early_return.metal', 'threadgroup_barrier')})" in \
        r.stderr and "threads 36-63 returned" in r.stderr, r.stderr


def test_divergent_barriers(emu_build, x):
    r = run(emu_build, "divergent_barrier", x[:64], 1, 64, 64)
    assert r.returncode == 1 and "do not meet at one barrier" in r.stderr
    lines = re.findall(r"early_return\.metal:(\d+)", r.stderr)
    assert len(set(lines)) == 2, r.stderr


def test_out_of_bounds_read_under_asan(asan_build, asan_driver_env, x):
    r = run(asan_build, "out_of_bounds", x, 1, 128, 128, env=asan_driver_env)
    assert r.returncode != 0 and "heap-buffer-overflow" in r.stderr, r.stderr[-4000:]
    assert line_of("out_of_bounds.metal", "in[i + 1]") in r.stderr, r.stderr[-4000:]


def test_address_space_mismatch_fails_the_lint(emu_build, x):
    # The run build accepts the kernel (address spaces vanish there) ...
    np.testing.assert_allclose(values(run(emu_build, "address_space", x[:32], 1, 32, 32)), 2 * x[:32])
    # ... the lint does not: a device pointer where a thread pointer is expected.
    r = subprocess.run([sys.executable, str(REWRITE), "--lint", str(BROKEN / "address_space.metal")],
                       capture_output=True, text=True)
    assert r.returncode == 1
    assert f"{line_of('address_space.metal', 'twice(in + i)')}" in r.stderr and "address space '1'" in r.stderr, \
        r.stderr


def test_inactive_lane_read(emu_build, x):
    r = run(emu_build, "inactive_lane", x[:48], 1, 48, 48)
    assert r.returncode == 1
    assert f"{line_of('simd_misuse.metal', 'simd_shuffle_down')}: simd_shuffle_down: reads lane 16, which is not " \
           "active" in r.stderr, r.stderr


def test_divergent_collective(emu_build, x):
    r = run(emu_build, "divergent_collective", x[:48], 1, 48, 48)
    assert r.returncode == 1 and "reach different collectives" in r.stderr
    assert line_of("simd_misuse.metal", "simd_sum") in r.stderr and line_of("simd_misuse.metal", "simd_max") in \
        r.stderr, r.stderr


def test_nonuniform_simdgroup_matrix(emu_build, x):
    r = run(emu_build, "nonuniform_matrix", x, 1, 32, 64)
    assert r.returncode == 1 and "non-uniform use" in r.stderr
    assert line_of("simd_misuse.metal", "simdgroup_load") in r.stderr, r.stderr


def test_limits(emu_build, x):
    r = run(emu_build, "too_much_threadgroup_memory", x[:32], 1, 32, 32)
    assert r.returncode == 1 and "32800 bytes, over Apple's limit" in r.stderr, r.stderr
    r = run(emu_build, "correct_reverse", np.tile(x, 9), 1, 1088, 64)
    assert r.returncode == 1 and "Metal allows 1 to 1024" in r.stderr, r.stderr
    # a kernel's own max_total_threads_per_threadgroup(64): 64 threads run, 128 are refused as Apple's pipeline would
    np.testing.assert_allclose(values(run(emu_build, "thread_limit", x, 2, 64, 128)), 2 * x)
    r = run(emu_build, "thread_limit", x, 1, 128, 128)
    assert r.returncode == 1 and "declares max_total_threads_per_threadgroup(64) at " + \
        line_of("thread_limit.metal", "void thread_limit") in r.stderr, r.stderr
