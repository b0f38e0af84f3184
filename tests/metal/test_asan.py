"""The kernel tests again in the ASan/UBSan build of the harness: every op case (test_metal_ops.py), device token
selection (test_metal_sample.py) and the tiny model's forward pass (test_metal_model.py), in forward order, the
switched op cases and the model also with every ablation switch off, a decode token's GDN layer also with the conv
apart. Any out-of-bounds access, use after free or
undefined behaviour in a kernel or a launcher aborts the run.

The sanitizer build only loads with its runtime preloaded, so the tests run in a subprocess (conftest.py: asan_env).
"""
import subprocess
import sys
from pathlib import Path

from .conftest import ASAN_CHILD

HERE = Path(__file__).resolve().parent
KERNEL_TESTS = ("test_metal_ops.py::test_op_matches_cpu", "test_metal_ops.py::test_op_matches_cpu_switches_off",
                "test_metal_ops.py::test_op_matches_cpu_conv_apart", "test_metal_sample.py", "test_metal_model.py")


def test_kernel_tests_under_asan(asan_env):
    env = dict(asan_env, **{ASAN_CHILD: "1"})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        *(str(HERE / t) for t in KERNEL_TESTS)], env=env, capture_output=True, text=True, timeout=2400)
    assert r.returncode == 0, f"the kernel tests under ASan/UBSan (rc {r.returncode}):\n{(r.stdout + r.stderr)[-12000:]}"
    assert " passed" in r.stdout and " skipped" not in r.stdout, r.stdout[-2000:]
