"""The address-space lint of the Metal CPU harness (tests/metal/harness/rewrite.py --lint) passes on every
metal/*.metal file: no device, threadgroup or constant pointer is passed where another address space is expected."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((REPO / "metal").glob("*.metal")), ids=lambda p: p.name)
def test_lint(path):
    r = subprocess.run([sys.executable, str(REPO / "tests" / "metal" / "harness" / "rewrite.py"), "--lint", str(path)],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, f"{path.name} fails the address-space lint:\n{r.stderr[-8000:]}"
