"""Group-relative advantages of one group (the G samples of one prompt), by ``rewards.advantage``:

    "grpo"             (r_i - mean(r)) / (std(r) + eps)     Shao et al. 2024 (DeepSeekMath)
    "drgrpo"           r_i - mean(r)                        Liu et al. 2025 (Dr. GRPO)
    "rloo"             r_i - mean_{j != i} r_j              Kool et al. 2019; Ahmadian et al. 2024
    "length_weighted"  r_i - sum_j L_j r_j / sum_j L_j      prime-rl ``length_weighted_mean``
    "pkg.mod:fn"       fn(rewards [G] float64, lengths [G] int64), imported once

Built-ins give exactly 0.0 for a group of equal rewards (so ``== 0`` checks work downstream); the
output is ``[G]`` float32 and finite, else ValueError.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import numpy as np

from tasks.import_path import import_callable

__all__ = [
    "ADVANTAGE_NAMES",
    "AdvantageFn",
    "compute_advantages",
    "drgrpo_advantages",
    "grpo_advantages",
    "length_weighted_advantages",
    "resolve_advantage_fn",
    "rloo_advantages",
]

AdvantageFn = Callable[[np.ndarray, np.ndarray], Any]
"""A custom estimator: ``fn(rewards [G] float64, completion_lengths [G] int64) -> [G]`` real values."""


def grpo_advantages(rewards: np.ndarray, eps: float) -> np.ndarray:
    """``(r_i - mean) / (std + eps)`` with the population std (ddof 0; TRL uses ddof 1), ``[G]`` float64 in
    and out. Source: DeepSeekMath (arXiv:2402.03300), Sec. 4.1.2, outcome supervision."""
    centered = rewards - rewards.mean()
    return centered / (rewards.std(ddof=0) + eps)


def drgrpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """``r_i - mean(r)``, ``[G]`` float64: no std division, which favours too easy or too hard questions.
    Source: Dr. GRPO (arXiv:2503.20783), Sec. 3."""
    return rewards - rewards.mean()


def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    """``r_i - (S - r_i) / (G - 1)`` (S = sum r), 0 when G == 1, ``[G]`` float64: a baseline without r_i,
    so unbiased. Sources: Kool et al. 2019 ("Buy 4 REINFORCE Samples"); Ahmadian et al. 2024
    (arXiv:2402.14740), Sec. 3."""
    group_size = rewards.size
    if group_size == 1:
        return np.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (group_size - 1)


def length_weighted_advantages(rewards: np.ndarray, completion_lengths: np.ndarray) -> np.ndarray:
    """``r_i - sum_j L_j r_j / sum_j L_j`` (``[G]`` float64, lengths ``[G]`` int64 tokens): the baseline
    that makes a token-level loss's advantages sum to 0, ``sum_i L_i A_i = 0``; the plain mean when all
    L_j are 0. Source: prime-rl's ``length_weighted_mean`` (src/prime_rl/orchestrator/advantage.py)."""
    total_tokens = completion_lengths.sum()
    if total_tokens == 0:
        return rewards - rewards.mean()
    baseline = (completion_lengths * rewards).sum() / total_tokens
    return rewards - baseline


_BUILTINS: dict[str, Callable[[np.ndarray, np.ndarray, float], np.ndarray]] = {
    "grpo": lambda r, lengths, eps: grpo_advantages(r, eps),
    "drgrpo": lambda r, lengths, eps: drgrpo_advantages(r),
    "rloo": lambda r, lengths, eps: rloo_advantages(r),
    "length_weighted": lambda r, lengths, eps: length_weighted_advantages(r, lengths),
}
ADVANTAGE_NAMES: tuple[str, ...] = tuple(_BUILTINS)
"""Names of the built-in estimators accepted by :func:`compute_advantages`."""


def resolve_advantage_fn(name: str) -> Union[str, AdvantageFn]:
    """A built-in name as is, else the :data:`AdvantageFn` at the import path (trusted config only).
    ValueError for an unknown name or an unresolvable path."""
    if not isinstance(name, str):
        raise ValueError(f"advantage must be a str (a name or 'package.module:function'), got {type(name).__name__}")
    if name in _BUILTINS:
        return name
    if ":" not in name:
        raise ValueError(
            f"unknown advantage estimator {name!r}; use one of {', '.join(ADVANTAGE_NAMES)} "
            "or an import path 'package.module:function'"
        )
    return import_callable(name, "advantage")


def compute_advantages(
    name_or_fn: Union[str, AdvantageFn],
    rewards: np.ndarray,
    completion_lengths: np.ndarray,
    eps: float = 1e-6,
) -> np.ndarray:
    """``[G]`` float32 advantages of one group (computed in float64). ``name_or_fn``: a built-in name,
    an import path (imported per call) or an :data:`AdvantageFn` (given copies); ``rewards``: ``[G]``
    reals, G >= 1; ``completion_lengths``: ``[G]`` ints >= 0, tokens; ``eps`` > 0, for grpo.

    Raises:
        ValueError: bad rewards, lengths or eps, an unknown estimator, or a custom output that is
            not ``[G]`` finite reals (after the float32 cast).
    """
    r = _validated_rewards(rewards)
    lengths = _validated_lengths(completion_lengths, r.size)
    if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and np.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}; use e.g. eps=1e-6")
    fn = resolve_advantage_fn(name_or_fn) if isinstance(name_or_fn, str) else name_or_fn
    if isinstance(fn, str):
        if np.all(r == r[0]):
            # Exact zeros (also G == 1): means of equal floats can be off by one ulp.
            return np.zeros(r.shape, dtype=np.float32)
        return _BUILTINS[fn](r, lengths, float(eps)).astype(np.float32)
    if not callable(fn):
        raise ValueError(f"advantage must be a name, an import path or a callable, got {type(fn).__name__}")
    return _validated_custom_output(fn, fn(r.copy(), lengths.copy()), r.size)


def _validated_rewards(rewards: np.ndarray) -> np.ndarray:
    """``rewards`` as ``[G]`` float64, else ValueError."""
    r = np.asarray(rewards)
    if r.dtype.kind not in "biuf":
        raise ValueError(f"rewards must be real numbers, got dtype {r.dtype}; pass a float array of shape [group_size]")
    if r.ndim != 1 or r.size == 0:
        raise ValueError(
            f"rewards must have shape [group_size] with group_size >= 1, got shape {r.shape}; "
            "pass one group's rewards as a 1-D array"
        )
    r = r.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(r))
    if bad.size:
        raise ValueError(
            f"rewards must be finite, got {r[bad[0]]} at index {int(bad[0])}; "
            "fix the reward function (or map failures to a finite reward) before computing advantages"
        )
    return r


def _validated_lengths(completion_lengths: np.ndarray, group_size: int) -> np.ndarray:
    """Lengths as ``[G]`` int64 >= 0, else ValueError."""
    lengths = np.asarray(completion_lengths)
    if lengths.dtype.kind not in "iu":
        raise ValueError(
            f"completion_lengths must be integers, got dtype {lengths.dtype}; pass the group's completion_lens"
        )
    if lengths.shape != (group_size,):
        raise ValueError(
            f"completion_lengths must have shape [group_size]=({group_size},) like rewards, got {lengths.shape}"
        )
    lengths = lengths.astype(np.int64)
    bad = np.flatnonzero(lengths < 0)
    if bad.size:
        raise ValueError(f"completion_lengths must be >= 0, got {int(lengths[bad[0]])} at index {int(bad[0])}")
    return lengths


def _validated_custom_output(fn: AdvantageFn, out: Any, group_size: int) -> np.ndarray:
    """A custom output as ``[G]`` float32 finite, else ValueError naming ``fn``."""
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        a = np.asarray(out)
    except Exception as exc:
        raise ValueError(f"custom advantage {name} returned {type(out).__name__}, not an array ({exc})") from exc
    if a.dtype.kind not in "biuf":
        raise ValueError(f"custom advantage {name} must return real numbers, got dtype {a.dtype}")
    if a.shape != (group_size,):
        raise ValueError(f"custom advantage {name} must return shape [group_size]=({group_size},), got {a.shape}")
    with np.errstate(over="ignore"):  # overflow to inf is reported below, by name
        a = a.astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(a))
    if bad.size:
        raise ValueError(
            f"custom advantage {name} returned a non-finite value at index {int(bad[0])} "
            "(NaN/inf, or beyond float32 range); fix the function"
        )
    return a
