"""Group-relative advantages (one group = the G samples drawn for one prompt).

A reward worker receives one whole group per message, so it computes the group's advantages alone
with :func:`compute_advantages`; nothing here depends on other groups. The estimator is chosen by
name (``rewards.advantage`` in the run config):

    name               A_i                                              source
    "grpo"             (r_i - mean(r)) / (std(r) + eps)                 Shao et al. 2024 (DeepSeekMath)
    "drgrpo"           r_i - mean(r)                                    Liu et al. 2025 (Dr. GRPO)
    "rloo"             r_i - mean_{j != i} r_j                          Kool et al. 2019; Ahmadian et al. 2024
    "length_weighted"  r_i - sum_j L_j r_j / sum_j L_j                  prime-rl `length_weighted_mean`
    "pkg.mod:fn"       fn(rewards [G] float64, lengths [G] int64)       a custom function, imported once

Invariants:
- Every built-in estimator returns exactly 0.0 for every sample of a group whose rewards are all
  equal (including a one-sample group), so "zero-advantage" checks downstream can test ``== 0``.
  A custom function is called as is (it may shape advantages on purpose); its output is checked.
- The output of :func:`compute_advantages` has shape ``[G]``, dtype float32, and is finite;
  non-finite rewards, bad lengths and bad custom outputs raise ValueError, never propagate NaN.
- Completion lengths ``L_j`` may be 0 (an empty completion): it weighs 0 in the length-weighted
  baseline; if every length is 0 that baseline falls back to the plain mean.
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
    """GRPO: rewards centred on the group mean and divided by the group's population std.

        mean = (1/G) sum_j r_j,   std = sqrt((1/G) sum_j (r_j - mean)^2)       (ddof = 0)
        A_i  = (r_i - mean) / (std + eps)

    Source: Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300), Sec. 4.1.2 (outcome supervision:
    A_i = (r_i - mean(r)) / std(r)). The paper does not say which std; we use the population std
    (TRL's `torch.std` is the sample std, ddof=1, larger by sqrt(G/(G-1))).

    Args:
        rewards: `[G]` float64, finite. eps: float > 0 added to the std.

    Returns:
        `[G]` float64 advantages (mean ~0, population std ~1 when std >> eps).
    """
    centered = rewards - rewards.mean()
    return centered / (rewards.std(ddof=0) + eps)


def drgrpo_advantages(rewards: np.ndarray) -> np.ndarray:
    """Dr. GRPO: rewards centred on the group mean, no std division.

        A_i = r_i - (1/G) sum_j r_j

    Source: Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
    (arXiv:2503.20783), Sec. 3: dividing by std(r) up-weights questions that are too easy or too
    hard (question-level difficulty bias), so Dr. GRPO drops it.

    Args:
        rewards: `[G]` float64, finite.

    Returns:
        `[G]` float64 advantages summing to ~0.
    """
    return rewards - rewards.mean()


def rloo_advantages(rewards: np.ndarray) -> np.ndarray:
    """RLOO: each sample's baseline is the mean reward of the OTHER G-1 samples of its group.

        A_i = r_i - (1/(G-1)) sum_{j != i} r_j = r_i - (S - r_i)/(G-1),   S = sum_j r_j
            = G/(G-1) * (r_i - mean(r))                                   (for G >= 2)
        A_i = 0                                                           (for G == 1: no other sample)

    The baseline does not depend on sample i's own reward, so the policy-gradient estimate stays
    unbiased. Sources: Kool, van Hoof, Welling 2019, "Buy 4 REINFORCE Samples, Get a Baseline for
    Free!" (ICLR DeepRLStructPred workshop); Ahmadian et al. 2024, "Back to Basics: Revisiting
    REINFORCE Style Optimization for Learning from Human Feedback in LLMs" (arXiv:2402.14740),
    Sec. 3 (the RLOO estimator, k samples per prompt).

    Args:
        rewards: `[G]` float64, finite.

    Returns:
        `[G]` float64 advantages; all 0 when G == 1.
    """
    group_size = rewards.size
    if group_size == 1:
        return np.zeros_like(rewards)
    return rewards - (rewards.sum() - rewards) / (group_size - 1)


def length_weighted_advantages(rewards: np.ndarray, completion_lengths: np.ndarray) -> np.ndarray:
    """Rewards centred on the group's token-weighted mean reward.

        baseline = sum_j L_j r_j / sum_j L_j          if sum_j L_j > 0
                 = (1/G) sum_j r_j                     if every L_j == 0 (fallback: plain mean)
        A_i      = r_i - baseline

    Definition: prime-rl's `length_weighted_mean` advantage option (PrimeIntellect-ai/prime-rl,
    `src/prime_rl/orchestrator/advantage.py`): baseline = (rewards * lengths).sum() / lengths.sum(),
    no std division. We found no other definition in verl, AReaL or TRL. Rationale: with a
    token-level loss each sample contributes L_i tokens that all carry A_i, and this baseline is
    the one that makes the group's TOKEN-level advantages sum to zero, sum_i L_i A_i = 0 (the
    plain mean makes the SAMPLE-level ones sum to zero). An empty completion (L_j = 0) has no
    tokens, so it weighs 0; if all completions are empty the weights are undefined (0/0) and we
    fall back to the plain mean rather than return NaN (prime-rl would divide by zero).

    Args:
        rewards: `[G]` float64, finite.
        completion_lengths: `[G]` int64 >= 0, tokens per completion.

    Returns:
        `[G]` float64 advantages with sum_i L_i A_i ~ 0 (or sum_i A_i ~ 0 in the fallback).
    """
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
    """Check an estimator reference once (at worker start): a built-in name, or import a custom one.

    Args:
        name: one of :data:`ADVANTAGE_NAMES`, or an import path ``"package.module:function"``
            (``function`` may be dotted, ``Class.method``). Importing runs the module's code, so the
            path must come from the (trusted) run config, never from the bus.

    Returns:
        The name itself for a built-in estimator, else the imported callable (an :data:`AdvantageFn`);
        either can be passed to :func:`compute_advantages`.

    Raises:
        ValueError: unknown name (the message lists the known ones), or an import path whose module
            does not import, has no such attribute, or names something not callable.
    """
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
    """Advantages of one group with the chosen estimator (the one entry point the worker calls).

    Args:
        name_or_fn: a built-in name (:data:`ADVANTAGE_NAMES`), an import path
            ``"package.module:function"`` (imported on every call: resolve it once with
            :func:`resolve_advantage_fn`), or a custom callable ``fn(rewards [G] float64,
            completion_lengths [G] int64) -> [G]`` (it gets copies, so it cannot alter the inputs).
        rewards: `[G]` real numbers (any int/float/bool dtype; array-likes accepted), one reward
            per sample, G >= 1.
        completion_lengths: `[G]` ints >= 0, tokens per completion (the group's ``completion_lens``).
        eps: finite float > 0, added to the std by "grpo" (ignored by the others).

    Returns:
        `[G]` float32 finite advantages (computed in float64). Built-ins give exactly 0.0 for
        every sample when all rewards are equal (so also when G == 1).

    Raises:
        ValueError: `rewards` not 1-D/empty/non-real/non-finite; `completion_lengths` not integer,
            negative or of another shape; `eps` not a finite number > 0; an unknown name or bad
            import path; a custom output of the wrong shape, non-real or non-finite (also after the
            cast to float32).
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
    """`rewards` as a `[G]` float64 array; ValueError names the problem and the fix."""
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
    """Completion lengths as a `[G]` int64 array of values >= 0; ValueError names the problem."""
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
    """A custom estimator's output as `[G]` float32 finite; ValueError names the function otherwise."""
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
