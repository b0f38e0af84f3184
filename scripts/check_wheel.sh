#!/usr/bin/env bash
# Checks a built wheel as a user without a compiler gets it: installs it (and its dependencies, binary only) into a
# fresh virtual environment, then, outside the clone and with only that environment on PATH (no compiler, no CMake,
# no nvcc), runs the tiny model through the CLI and a smoke subset of the tests against the installed package.
# Usage: scripts/check_wheel.sh WHEEL      PYTHON: the interpreter for the environment (default: python3)
set -euo pipefail
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: scripts/check_wheel.sh WHEEL" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
wheel=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${PYTHON:-python3}" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --only-binary=:all: "$wheel" pytest pexpect mypy
smoke() { (cd "$tmp" && env -i HOME="$HOME" LANG=C.UTF-8 TERM=xterm PATH="$tmp/venv/bin" "$@"); }
smoke python - <<'PY'
import shutil
import sys

import lily

on_path = [t for t in ("cc", "gcc", "g++", "c++", "clang", "clang++", "cmake", "ninja", "nvcc") if shutil.which(t)]
assert not on_path, f"a build tool is on PATH: {on_path}"
assert lily.__file__.startswith(sys.prefix), f"lily comes from {lily.__file__}, not the wheel"
print("check_wheel.sh: lily from", lily.__file__)
print(*lily.backends(), sep="\n")
PY
smoke lily generate --model tiny --prompt "Hello, Lily" --max-tokens 32
smoke python -m pytest -q -p no:cacheprovider "$repo"/tests/test_backends.py "$repo"/tests/test_cli.py \
  "$repo"/tests/test_cli_terminal.py "$repo"/tests/test_interrupts.py "$repo"/tests/test_typing.py \
  "$repo"/tests/test_sampling.py "$repo"/tests/test_prefix_cache.py "$repo"/tests/test_cuda.py "$repo"/tests/ops
echo "check_wheel.sh: $(basename "$wheel") passed"
