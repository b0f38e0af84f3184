"""Shared fixtures: the oracle checkpoints of tests/oracle.py (built once per run, on first use), the Lily
models loaded from them, the built-in tiny model, and a fresh random generator per test."""

import os
import secrets
import sys
from pathlib import Path

import numpy as np
import pytest

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

# The tests compare the CPU reference with mlx-lm: a model loaded without a backend runs on the CPU here (and in the
# `lily` commands the tests start), where lily.load's own default would pick a GPU. GPU tests name their backend;
# the tests of the default choice itself (test_backends.py) unset this.
os.environ["LILY_BACKEND"] = "cpu"

import lily  # noqa: E402
from lily.tiny import build_tiny  # noqa: E402


class OracleCheckpoints:
    """Each geometry of oracle.GEOMETRIES converted by mlx-lm once per run, with a fresh random seed (in the
    directory name, so failures show it), and one shared Lily model per geometry."""

    def __init__(self, root: Path):
        self.root = root
        self._paths: dict[str, Path] = {}
        self._models: dict[str, lily.Model] = {}

    def path(self, geometry: str) -> Path:
        if geometry not in self._paths:
            import oracle  # mlx-lm is needed only by the tests that build oracle checkpoints

            seed = secrets.randbits(32)
            self._paths[geometry] = oracle.make_checkpoint(self.root / f"{geometry}-seed{seed}", geometry, seed)
        return self._paths[geometry]

    def model(self, geometry: str) -> lily.Model:
        """The shared model of a geometry: tests must not change its attributes."""
        if geometry not in self._models:
            self._models[geometry] = lily.load(self.path(geometry))
        return self._models[geometry]

    def new_model(self, geometry: str) -> lily.Model:
        """A model instance of its own, for tests that change attributes such as eos_token_ids."""
        return lily.load(self.path(geometry))


@pytest.fixture(scope="session")
def oracle_checkpoints(tmp_path_factory) -> OracleCheckpoints:
    return OracleCheckpoints(tmp_path_factory.mktemp("oracle-ckpt"))


@pytest.fixture(params=["a", "b", "c"])  # the names of oracle.GEOMETRIES (tests/test_oracle.py checks them)
def geometry(request) -> str:
    return request.param


@pytest.fixture
def ckpt(oracle_checkpoints, geometry) -> Path:
    """The converted checkpoint directory of the test's geometry."""
    return oracle_checkpoints.path(geometry)


@pytest.fixture
def model(oracle_checkpoints, geometry) -> lily.Model:
    """The shared Lily model of the test's geometry (do not change its attributes)."""
    return oracle_checkpoints.model(geometry)


@pytest.fixture(scope="session")
def tiny_model() -> lily.Model:
    """The built-in tiny model, shared (do not change its attributes)."""
    return lily.load("tiny")


@pytest.fixture(scope="session")
def _tiny_checkpoint():
    return build_tiny()


@pytest.fixture
def new_tiny_model(_tiny_checkpoint):
    """Factory of tiny-model instances of their own (the same weights as lily.load("tiny")), for tests that
    change attributes such as eos_token_ids or the tokenizer."""
    return lambda: lily.Model(_tiny_checkpoint)


# Qwen3.6's real chat template: model data beside the repository (never copied into it); absent in some clones.
REAL_TEMPLATE = TESTS_DIR.parent.parent / "shared" / "data" / "qwen3.6" / "chat_template.jinja"


@pytest.fixture
def real_template_model(new_tiny_model):
    """A tiny model of its own that renders with the real chat template; the test skips where it is absent."""
    if not REAL_TEMPLATE.is_file():
        pytest.skip(f"the real chat template is not at {REAL_TEMPLATE}")
    model = new_tiny_model()
    model.tokenizer.chat_template = REAL_TEMPLATE.read_text(encoding="utf-8")
    return model


@pytest.fixture
def rng() -> np.random.Generator:
    """A freshly seeded generator; the seed is printed so that a failure can be replayed."""
    seed = secrets.randbits(64)
    print(f"rng seed: {seed}")
    return np.random.default_rng(seed)
