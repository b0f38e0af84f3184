"""Fixtures of the Metal CPU harness tests (tests/metal/harness/README.md).

The core is built once per session with LILY_METAL_EMU=ON as the module `_core_metal_emu` (every metal/*.metal
kernel compiled as C++ by clang, dispatched through the fiber scheduler) under build/metal-emu, and on demand with
ASan/UBSan under build/metal-emu-asan (that module only loads with the sanitizer runtime preloaded, so its tests
run in a subprocess: see `asan_env`). The whole directory is skipped when no clang >= 17 is installed.
"""
from __future__ import annotations

import fcntl
import importlib
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lily

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MODULE = "_core_metal_emu"
# Set in the subprocess of an ASan test: import the module from this directory, do not build.
MODULE_DIR_ENV = "LILY_METAL_MODULE_DIR"
# Set in the ASan/UBSan run of the kernel tests (test_asan.py), which takes one thread order.
ASAN_CHILD = "LILY_METAL_ASAN_CHILD"
THREAD_ORDERS = ("forward",) if os.environ.get(ASAN_CHILD) else ("forward", "reverse", "random")


def find_clang() -> str | None:
    """clang++ >= 17 (LILY_METAL_CLANG, else clang++-19/18/17, else clang++), or None."""
    for name in (os.environ.get("LILY_METAL_CLANG"), "clang++-19", "clang++-18", "clang++-17", "clang++"):
        path = shutil.which(name) if name else None
        if path:
            m = re.search(r"clang version (\d+)", subprocess.run([path, "--version"], capture_output=True,
                                                                  text=True).stdout)
            if m and int(m.group(1)) >= 17:
                return path
    return None


CLANG = find_clang()
if CLANG:
    os.environ.setdefault("LILY_METAL_CLANG", CLANG)  # the compiler of rewrite.py --lint


def pytest_collection_modifyitems(config, items):
    if CLANG:
        return
    skip = pytest.mark.skip(reason="the Metal CPU harness needs clang >= 17 (apt-get install clang-19 "
                                   "libclang-rt-19-dev, or set LILY_METAL_CLANG)")
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(skip)


def pytest_generate_tests(metafunc):
    """A test that takes `thread_order` runs in every order of the harness (forward only in the ASan run)."""
    if "thread_order" in metafunc.fixturenames:
        metafunc.parametrize("thread_order", THREAD_ORDERS)


def build(name: str, *options: str) -> Path:
    """Configures (first time) and builds build/<name>; fails the test with the compiler output on error."""
    out = REPO / "build" / name
    out.mkdir(parents=True, exist_ok=True)
    steps = [["cmake", "-S", str(REPO), "-B", str(out), "-G", "Ninja", "-DLILY_METAL_EMU=ON", "-DLILY_CUDA=OFF",
              f"-DLILY_MODULE_NAME={MODULE}", f"-DCMAKE_CXX_COMPILER={CLANG}", f"-DPython_EXECUTABLE={sys.executable}",
              *options],
             ["ninja", "-C", str(out)]]
    with open(out / ".lily-build-lock", "w") as lock:  # one build at a time in a directory (parallel sessions)
        fcntl.flock(lock, fcntl.LOCK_EX)
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                pytest.fail(f"Metal harness build failed: {' '.join(cmd)}\n{(r.stdout + r.stderr)[-8000:]}",
                            pytrace=False)
    return out


def load(directory: Path):
    if str(directory) not in sys.path:
        sys.path.insert(0, str(directory))
    return importlib.import_module(MODULE)


@pytest.fixture(scope="session")
def emu_build() -> Path:
    return Path(os.environ[MODULE_DIR_ENV]) if MODULE_DIR_ENV in os.environ else build("metal-emu")


@pytest.fixture(scope="session")
def core(emu_build):
    """The harness build of lily's core: core.testing.run_op("metal", ...) runs the Metal kernels."""
    return load(emu_build)


@pytest.fixture(scope="session")
def asan_build() -> Path:
    return build("metal-emu-asan", "-DLILY_METAL_SANITIZE=ON")


def asan_runtime() -> str:
    for name in (f"libclang_rt.asan-{platform.machine()}.so", "libclang_rt.asan.so"):
        path = subprocess.run([CLANG, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if os.path.isabs(path) and os.path.exists(path):
            return path
    pytest.fail("the ASan runtime of clang is missing (apt-get install libclang-rt-19-dev)", pytrace=False)


@pytest.fixture(scope="session")
def asan_env(asan_build) -> dict:
    """Environment of a subprocess that uses the ASan build (its module or tools)."""
    env = dict(os.environ)
    env.update(LD_PRELOAD=asan_runtime(), ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", **{MODULE_DIR_ENV: str(asan_build)})
    symbolizer = Path(CLANG).resolve().parent / "llvm-symbolizer"  # .metal lines in the reports
    if symbolizer.exists():
        env["ASAN_SYMBOLIZER_PATH"] = str(symbolizer)
    # The child imports the same installed `lily` as this process (site-packages or the editable finder).
    lily_root = Path(lily.__file__).resolve().parents[1]
    if (lily_root / "lily" / "__init__.py").exists() and any(lily_root.glob("lily/_core*")):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(lily_root), env.get("PYTHONPATH")]))
    return env
