"""Per-token off-policy lag of a step's loss tokens: counts per micro-batch, fractions per step.

The lag of a token trained at step ``s`` is ``s - v``, where ``v`` is the policy version that
sampled it (``MicroBatch.token_versions``, from the producer's run-length version spans; a partial
rollout mixes versions within one sample). :func:`lag_token_counts` buckets a micro-batch's loss
tokens into lags ``0, 1, ..., LAG_BUCKETS - 2`` and ``>= LAG_BUCKETS - 1``, as stats keys
``lag_tokens/<bucket>`` that :func:`trainer.trainer.merge_stats` sums over micro-batches and
ranks; :func:`lag_fractions` turns the step's totals into ``lag_frac/<bucket>`` metrics.

Invariants: every bucket is reported (zeros included), so a step's fractions sum to 1 whenever it
has loss tokens (none are reported for a step without any); a negative lag (a token sampled by a
policy newer than the step, possible only after a resumed trainer rolled the policy back) counts
as lag 0.
"""

from __future__ import annotations

import numpy as np

LAG_BUCKETS = 4
"""Buckets reported: lags 0, 1, 2 and >= 3."""

BUCKET_NAMES = [*(str(k) for k in range(LAG_BUCKETS - 1)), f">={LAG_BUCKETS - 1}"]
"""Bucket names, in lag order: ``["0", "1", "2", ">=3"]``."""

COUNT_PREFIX, FRAC_PREFIX = "lag_tokens/", "lag_frac/"


def lag_token_counts(token_versions: np.ndarray, loss_mask: np.ndarray, step: int) -> dict[str, float]:
    """Loss tokens per lag bucket of one micro-batch, from its host arrays (no device involved).

    Args:
        token_versions: ``[T] int64`` policy version of each token. loss_mask: ``[T] bool``
            (numpy arrays, or CPU tensors).
        step: the optimizer step being trained (= the trained weights' version).

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
