"""Sampling parameters, and the NumPy reference sampler that lily._core.Sampler and the device ops are tested against.

Order (vLLM's): penalties → temperature → top-k → top-p → min-p → renormalise → draw. The kept-set rules (ties at
a boundary are kept or dropped together) and the counter-based draw are specified in csrc/core/sample.h.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field

import numpy as np

MAX_TOP_LOGPROBS = 20
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass
class SamplingParams:
    temperature: float = 1.0         # 0 => greedy (argmax; ties: lowest id)
    top_k: int = 0                   # 0 => off
    top_p: float = 1.0               # 1 => off
    min_p: float = 0.0               # 0 => off; relative to the max prob after temperature
    repetition_penalty: float = 1.0  # logit>0 ? logit/r : logit*r over prompt + generated ids (HF/vLLM)
    presence_penalty: float = 0.0    # logit -= presence if generated at least once (OpenAI)
    frequency_penalty: float = 0.0   # logit -= frequency * times generated (OpenAI)
    seed: int | None = None          # None => a fresh random seed at each to_core()
    top_logprobs: int = 0            # alternatives reported per token (0..20)
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False

    def __post_init__(self):
        rules = [
            ("temperature", self.temperature >= 0 and math.isfinite(self.temperature), "finite and >= 0"),
            ("top_k", self.top_k >= 0, ">= 0 (0 = off)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty),
             "finite and > 0"),
            ("presence_penalty", math.isfinite(self.presence_penalty), "finite"),
            ("frequency_penalty", math.isfinite(self.frequency_penalty), "finite"),
            ("seed", self.seed is None or 0 <= self.seed <= _MASK64, "None or in [0, 2**64)"),
            ("top_logprobs", 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, f"in 0..{MAX_TOP_LOGPROBS}"),
            ("max_tokens", self.max_tokens >= 1, ">= 1"),
            ("stop", isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "a list of non-empty strings"),
        ]
        for name, ok, requirement in rules:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {requirement}, got {getattr(self, name)!r}")

    @classmethod
    def from_generation_config(cls, gen: dict, **overrides) -> SamplingParams:
        """Defaults from a generation_config.json dict, then overrides. `do_sample: false` means greedy; absent keys
        keep Lily's defaults (vLLM's reading, not transformers', whose absent do_sample means greedy)."""
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        kw = {k: gen[k] for k in keys if gen.get(k) is not None}
        if gen.get("do_sample") is False:
            kw["temperature"] = 0.0
        return cls(**{**kw, **overrides})

    def to_core(self):
        """The lily._core.SamplingParams for one sequence (seed None => a fresh random 63-bit seed)."""
        from lily import _core

        return _core.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, top_logprobs=self.top_logprobs,
            seed=secrets.randbits(63) if self.seed is None else self.seed)


def draw_uniform(seed: int, step: int) -> float:
    """u in [0, 1) for the given seed and step: to_unit_double(splitmix64(seed ^ step * golden))."""
    z = ((seed ^ (step * _GOLDEN)) + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) * 2.0**-53


def reference_probs(logits: np.ndarray, params, prompt_ids, generated_ids, n_valid: int) -> np.ndarray:
    """float64 [len(logits)]: the distribution the sampler draws from (one-hot at the argmax when greedy).
    `params` is a SamplingParams or a lily._core.SamplingParams."""
    x = np.asarray(logits, np.float64)[:n_valid].copy()
    gen = np.asarray(generated_ids, np.int64)
    seen = np.union1d(np.asarray(prompt_ids, np.int64), gen)
    r = params.repetition_penalty
    x[seen] = np.where(x[seen] > 0, x[seen] / r, x[seen] * r)
    count = np.bincount(gen, minlength=n_valid)
    x -= params.frequency_penalty * count + params.presence_penalty * (count > 0)

    out = np.zeros(len(logits))
    if params.temperature == 0:
        out[np.argmax(x)] = 1.0
        return out
    x /= params.temperature
    keep = np.ones(n_valid, bool)
    if 0 < params.top_k < n_valid:
        keep &= x >= np.sort(x)[-params.top_k]
    w = np.exp(x - x.max())  # p_i / p_max
    if params.top_p < 1:
        p = np.where(keep, w, 0.0) / w[keep].sum()
        s = np.sort(p)[::-1]
        mass_above = np.concatenate(([0.0], np.cumsum(s)))[np.searchsorted(-s, -p, side="left")]
        keep &= mass_above < params.top_p
    keep &= w >= params.min_p
    p = np.where(keep, w, 0.0)
    out[:n_valid] = p / p.sum()
    return out


def reference_sample(logits: np.ndarray, params, prompt_ids, generated_ids, n_valid: int) -> int:
    """The token the sampler draws at step len(generated_ids): first id whose cumulative prob exceeds u."""
    if params.seed is None:
        raise ValueError("reference_sample: params.seed must be set")
    c = np.cumsum(reference_probs(logits, params, prompt_ids, generated_ids, n_valid))
    return int(np.searchsorted(c, draw_uniform(params.seed, len(generated_ids)) * c[-1], side="right"))
