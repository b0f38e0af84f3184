"""Which backend runs a model: what this build has, what can run on this machine and why not, and the default.

    >>> for b in lily.backends(): print(b)
    cuda: compiled in, cannot run here: no CUDA driver is installed (libcuda.so.1, … was not found) …
    metal: cannot run here: not compiled into this build of Lily (Metal is built on macOS only)
    cpu: usable (x86_64, 16 threads)

With no backend given, `lily.load` and the `lily` command take LILY_BACKEND when it is set, else the first usable
backend of cuda, metal, cpu ("auto").
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from lily import _core

NAMES = ("cuda", "metal", "cpu")  # the order the default choice tries them


@dataclass(frozen=True)
class BackendInfo:
    name: str       # "cuda", "metal" or "cpu"
    compiled: bool  # built into this installation of Lily
    usable: bool    # compiled in, and its device answers here
    reason: str     # why it cannot run here (not compiled, no device, driver too old …); "" when usable
    device: str     # what it runs on when usable ("NVIDIA H200", "x86_64, 16 threads"); "" otherwise

    def __str__(self) -> str:
        if self.usable:
            return f"{self.name}: usable ({self.device})"
        return f"{self.name}: {'compiled in, ' if self.compiled else ''}cannot run here: {self.reason}"


def backends() -> list[BackendInfo]:
    """Every backend Lily has, in the order the default choice tries them (cuda, metal, cpu): whether it is compiled
    into this build, whether it can run here, and if not, why. A GPU backend's driver is started to find out."""
    return [BackendInfo(**b) for b in _core.backends()]


def backend_names() -> list[str]:
    """Names of the backends compiled into this build (usable here or not)."""
    return list(_core.compiled_backends())


def resolve_backend(backend: str | None = None) -> str:
    """The backend a model gets: `backend` if given; None means LILY_BACKEND when set, else "auto"; "auto" is the
    first usable of cuda, metal, cpu. An unknown name is a ValueError; a named backend that cannot run here fails
    when the model is created, saying why (here already when LILY_BACKEND named it, so that the error says so)."""
    source = ""
    if backend is None:
        backend = os.environ.get("LILY_BACKEND", "").strip() or "auto"
        source = f"LILY_BACKEND={backend}: "
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a string (auto, {', '.join(NAMES)}), got {type(backend).__name__}")
    if backend != "auto":
        if backend not in NAMES:
            raise ValueError(f"{source}unknown backend {backend!r} (Lily has auto, {', '.join(NAMES)}; compiled "
                             f"into this build: {', '.join(backend_names())})")
        if source and backend != "cpu":  # (the CPU always runs; probing it would start a GPU driver for nothing)
            info = next(b for b in backends() if b.name == backend)
            if not info.usable:
                raise ValueError(f"{source}backend {backend!r} cannot run here: {info.reason}")
        return backend
    return next(b.name for b in backends() if b.usable)  # the CPU always is


def default_backend() -> str:
    """The backend `lily.load` uses when none is given (LILY_BACKEND, else the first usable of cuda, metal, cpu)."""
    return resolve_backend(None)


def unusable_gpus() -> list[BackendInfo]:
    """The GPU backends compiled into this build that cannot run here (what a user on a GPU machine wants to know
    when the CPU was chosen)."""
    return [b for b in backends() if b.compiled and not b.usable]
