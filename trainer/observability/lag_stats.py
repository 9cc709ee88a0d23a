"""Per-token off-policy lag of a step's loss tokens: counts per micro-batch, fractions per step.

A token sampled by policy version ``v`` and trained at step ``s`` has lag ``s - v`` (a partial
rollout mixes versions within a sample). Buckets ``0, 1, ..., LAG_BUCKETS - 2`` and ``>=
LAG_BUCKETS - 1`` are all reported, zeros included, so a step's fractions sum to 1; a negative lag
(after a resume rolled the policy back) counts as 0.
"""

from __future__ import annotations

import numpy as np

LAG_BUCKETS = 4
"""Buckets reported: lags 0, 1, 2 and >= 3."""

BUCKET_NAMES = [*(str(k) for k in range(LAG_BUCKETS - 1)), f">={LAG_BUCKETS - 1}"]
"""Bucket names, in lag order: ``["0", "1", "2", ">=3"]``."""

COUNT_PREFIX, FRAC_PREFIX = "lag_tokens/", "lag_frac/"


def lag_token_counts(token_versions: np.ndarray, loss_mask: np.ndarray, step: int) -> dict[str, float]:
    """Loss tokens per lag bucket of one micro-batch, from its host arrays.

    Args:
        token_versions: ``[T] int64`` policy version of each token. loss_mask: ``[T] bool``.
        step: the optimizer step being trained.

    Returns:
        ``{"lag_tokens/<bucket>": count}`` for every bucket of :data:`BUCKET_NAMES`.
    """
    versions = np.asarray(token_versions, dtype=np.int64)
    lags = np.clip(step - versions[np.asarray(loss_mask, dtype=bool)], 0, LAG_BUCKETS - 1)
    counts = np.bincount(lags, minlength=LAG_BUCKETS).tolist()
    return {COUNT_PREFIX + name: float(c) for name, c in zip(BUCKET_NAMES, counts)}


def lag_fractions(totals: dict[str, float]) -> dict[str, float]:
    """Pop the ``lag_tokens/*`` step totals from ``totals`` and return ``{"lag_frac/<bucket>":
    fraction of the step's loss tokens}`` (sums to 1), or ``{}`` when the step has no loss token."""
    counts = {name: totals.pop(COUNT_PREFIX + name, 0.0) for name in BUCKET_NAMES}
    total = sum(counts.values())
    return {FRAC_PREFIX + name: c / total for name, c in counts.items()} if total > 0 else {}
