"""The typed Python surface: lily/_core.pyi (written by nanobind's stubgen at build time and installed beside the
compiled module) and py.typed, so that editors and mypy see Model, Session, Generator and their arguments."""
import shutil
from pathlib import Path

import pytest

import lily
from lily import _core

SNIPPET = """\
import numpy as np
import lily
from lily import _core

model: lily.Model = lily.load("tiny")
session = model.session(max_context=64)
position: int = session.core.position
logits = session.core.prefill(np.array([1, 2], np.int32), progress=lambda done, total: None)
generator = _core.Generator(session.core, _core.SamplingParams(temperature=0.5), [1], 4, model.n_valid)
token, logprob, top_ids, top_logprobs, finish = generator.next()
assert isinstance(token + finish, int) and isinstance(logprob, float) and top_ids[:1] == [] and top_logprobs[:0] == []
infos: list[lily.BackendInfo] = lily.backends()
wrong: str = session.core.position
_core.Generator(session.core, 0.5, [1], 4, model.n_valid)
session.core.prefill(np.array([1], np.int32), progress=3)
model.core.session(max_context="long")
"""
ERROR_LINES = [13, 14, 15, 16]  # the last four lines, each a type error


def test_stub_and_marker_are_installed():
    stub = Path(_core.__file__).with_name("_core.pyi")
    assert stub.is_file(), f"no stub beside {_core.__file__}"
    text = stub.read_text()
    for needle in ("class Model:", "class Session:", "class Generator:", "class SamplingParams:",
                   "def prefill(self, tokens:", "progress: Callable | None = None", "def backends() -> list[dict[str, str | bool]]:",
                   "def next(self) -> tuple[int, float, list[int], list[float], int]:"):
        assert needle in text, needle
    assert "testing" not in text  # the test-only submodule is left out
    assert Path(lily.__file__).with_name("py.typed").is_file()


def test_mypy_sees_the_compiled_classes(tmp_path, monkeypatch):
    api = pytest.importorskip("mypy.api")
    # The package as mypy finds it installed: its Python files, py.typed and the stub. (In an editable install the
    # compiled module and its stub live in the build directory, where mypy does not look.)
    site = tmp_path / "site"
    shutil.copytree(Path(lily.__file__).parent, site / "lily", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(Path(_core.__file__).with_name("_core.pyi"), site / "lily" / "_core.pyi")
    (tmp_path / "use.py").write_text(SNIPPET)
    monkeypatch.setenv("MYPYPATH", str(site))
    out, err, _ = api.run([str(tmp_path / "use.py"), "--follow-imports=silent", "--no-error-summary",
                           "--cache-dir", str(tmp_path / "cache")])
    lines = sorted({int(line.split(":")[1]) for line in out.splitlines() if ": error:" in line})
    assert lines == ERROR_LINES, out + err
