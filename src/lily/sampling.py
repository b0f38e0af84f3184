"""Sampling parameters, and the NumPy reference sampler that lily._core.Sampler and the device ops are tested against.

Order (vLLM's): logit bias → penalties → temperature → top-k → top-p → min-p → renormalise → draw. The kept-set
rules (ties at a boundary are kept or dropped together) and the counter-based draw are specified in
csrc/core/sample.h.
"""

from __future__ import annotations

import numbers
import secrets
from dataclasses import dataclass, field

import numpy as np

MAX_TOP_LOGPROBS = 20
INT32_MAX = 2**31 - 1
# The ranges in which the sampler's 32-bit arithmetic (csrc/core/sample.cpp) cannot overflow for logits below 1e20
# in magnitude and up to 2**31 generated tokens: x / repetition_penalty - frequency_penalty * count - presence_penalty,
# divided by the temperature, stays below 1e30. A temperature outside its range is greedy or uniform in all but name.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 1e5
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-5, 1e5
MAX_PENALTY = 1e5  # |presence_penalty|, |frequency_penalty|
# Stop strings: each is searched for at every token, so their count is bounded (OpenAI's API allows 4).
MAX_STOPS = 64
# logit_bias: OpenAI's range of a bias (-100 bans a token, 100 all but forces it); entries bounded as stop strings are.
MAX_BIAS = 100
MAX_BIAS_ENTRIES = 1024
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
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit first (OpenAI)
    ignore_eos: bool = False         # True => end-of-sequence tokens do not end the reply (vLLM's, for benchmarks)
    min_tokens: int = 0              # no end-of-sequence token among the first min_tokens (vLLM's; not stop strings)

    def __post_init__(self):
        for name, kinds, ok, requirement in _RULES:
            value = getattr(self, name)
            if not _is_a(value, kinds):
                raise ValueError(f"SamplingParams.{name} must be {_kind_names(kinds)}, got {_show(value)}")
            if not ok(value):
                got = f"a list of {len(value)} strings" if name == "stop" and len(value) > MAX_STOPS else _show(value)
                raise ValueError(f"SamplingParams.{name} must be {requirement}, got {got}")
            if kinds == _REAL and not ok(float(np.float32(value))):  # the core reads it as a 32-bit float
                raise ValueError(f"SamplingParams.{name} must be {requirement}, got {_show(value)} "
                                 f"({float(np.float32(value))!r} as a 32-bit float)")

    @classmethod
    def from_generation_config(cls, gen: dict, **overrides) -> SamplingParams:
        """Defaults from a generation_config.json dict, then overrides. `do_sample: false` means greedy; absent keys
        keep Lily's defaults (vLLM's reading, not transformers', whose absent do_sample means greedy).
        `max_new_tokens` is the default of max_tokens (else 256, as mlx-lm); `max_length`, which counts the prompt
        too, is not used."""
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
        kw = {k: gen[k] for k in keys if gen.get(k) is not None}
        if gen.get("do_sample") is False:
            kw["temperature"] = 0.0
        if gen.get("max_new_tokens") is not None:
            kw["max_tokens"] = gen["max_new_tokens"]
        return cls(**{**kw, **overrides})

    def bias_arrays(self) -> tuple[list[int], list[float]]:
        """logit_bias as the core takes it: ids ascending and their biases."""
        ids = sorted(int(i) for i in self.logit_bias)
        return ids, [float(self.logit_bias[i]) for i in ids]

    def to_core(self):
        """The lily._core.SamplingParams for one sequence (seed None => a fresh random 63-bit seed)."""
        from lily import _core

        return _core.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, top_logprobs=self.top_logprobs,
            seed=secrets.randbits(63) if self.seed is None else self.seed)


_REAL, _INT, _SEED = (numbers.Real,), (numbers.Integral,), (numbers.Integral, type(None))


def _is_a(value, kinds: tuple) -> bool:
    """isinstance, with a boolean no number."""
    return isinstance(value, kinds) and (not isinstance(value, (bool, np.bool_)) or bool in kinds)


def _kind_names(kinds: tuple) -> str:
    names = {numbers.Real: "a number", numbers.Integral: "an integer", bool: "a boolean", list: "a list",
             dict: "a dict", type(None): "None"}
    return " or ".join(names[k] for k in kinds)


def _show(value) -> str:
    """A short repr for error messages (an integer too long for repr is described by its size)."""
    try:
        text = repr(value)
    except ValueError:
        return f"an integer of {value.bit_length()} bits"
    return text if len(text) <= 80 else text[:77] + "..."


def _in(lo, hi):
    return lambda v: lo <= v <= hi


# (field, accepted types, check, what the check requires). Comparisons of Python ints with floats are exact, so a
# huge integer fails its range check rather than overflowing.
_RULES = [
    ("temperature", _REAL, lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
     f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"),
    ("top_k", _INT, _in(0, INT32_MAX), f"in [0, {INT32_MAX}] (0 = off)"),
    ("top_p", _REAL, lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", _REAL, _in(0, 1), "in [0, 1]"),
    ("repetition_penalty", _REAL, _in(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
     f"in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)"),
    ("presence_penalty", _REAL, _in(-MAX_PENALTY, MAX_PENALTY), f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
    ("frequency_penalty", _REAL, _in(-MAX_PENALTY, MAX_PENALTY), f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"),
    ("seed", _SEED, lambda v: v is None or 0 <= v <= _MASK64, "None or in [0, 2**64)"),
    ("top_logprobs", _INT, _in(0, MAX_TOP_LOGPROBS), f"in 0..{MAX_TOP_LOGPROBS}"),
    ("max_tokens", _INT, _in(1, INT32_MAX), f"in [1, {INT32_MAX}]"),
    ("stop", (list,), lambda v: len(v) <= MAX_STOPS and all(isinstance(s, str) and s for s in v),
     f"a list of at most {MAX_STOPS} non-empty strings"),
    ("logprobs", (bool,), lambda v: True, "a boolean"),
    ("logit_bias", (dict,), lambda v: len(v) <= MAX_BIAS_ENTRIES and all(
        _is_a(i, _INT) and 0 <= i <= INT32_MAX and _is_a(b, _REAL) and -MAX_BIAS <= b <= MAX_BIAS
        for i, b in v.items()),
     f"a dict of at most {MAX_BIAS_ENTRIES} token ids (integers >= 0) to biases in [-{MAX_BIAS}, {MAX_BIAS}]"),
    ("ignore_eos", (bool,), lambda v: True, "a boolean"),
    ("min_tokens", _INT, _in(0, INT32_MAX), f"in [0, {INT32_MAX}]"),
]


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
    if isinstance(params, SamplingParams):
        ids, biases = params.bias_arrays()
        x[ids] = x[ids].astype(np.float32) + np.asarray(biases, np.float32)  # the core's float32 sum
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
