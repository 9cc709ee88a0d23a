"""Group-relative advantages for GRPO (one group = the G samples drawn for one prompt).

A reward worker receives one whole group per message, so it can compute the group's advantages
alone with `group_advantages`; nothing here depends on other groups.

Invariants:
- The output has the input's shape `[group_size]` and dtype float32.
- A group whose rewards are all equal (including a one-sample group) gets advantages that are
  exactly 0.0, so "zero-advantage group" filters downstream can test `== 0` safely.
- With `std_normalize=True` the advantages have mean ~0 and population std ~1 (up to `eps`).
- Non-finite rewards are rejected (ValueError), never propagated as NaN.
"""

from __future__ import annotations

import numpy as np

__all__ = ["group_advantages"]


def group_advantages(
    rewards: np.ndarray, *, std_normalize: bool = True, eps: float = 1e-6
) -> np.ndarray:
    """Group-relative advantages of one group's rewards.

    Formula (computed in float64, returned as float32), with population statistics over the group:

        mean = (1/G) * sum_j r_j
        std  = sqrt((1/G) * sum_j (r_j - mean)^2)              # population std, ddof=0
        A_i  = (r_i - mean) / (std + eps)     if std_normalize  # GRPO
        A_i  =  r_i - mean                    otherwise         # Dr. GRPO

    Sources: GRPO outcome supervision, Shao et al. 2024, "DeepSeekMath" (arXiv:2402.03300),
    Sec. 4.1.2: A_i = (r_i - mean(r)) / std(r); the paper does not say which std, we use the
    population std (ddof=0; TRL's `torch.std` uses ddof=1, larger by sqrt(G/(G-1))). Dropping the
    std division is Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical
    Perspective" (arXiv:2503.20783), Sec. 3, which removes the per-question difficulty bias.

    Args:
        rewards: `[group_size]` real numbers (any float/int/bool dtype; array-likes accepted),
            one scalar reward per sample of the group, in the verifier's units.
        std_normalize: divide by the group's population std (GRPO) or not (Dr. GRPO).
        eps: added to the std before dividing, > 0; only used when `std_normalize`.

    Returns:
        `[group_size]` float32 advantages. All-equal rewards (and `group_size == 1`) give exactly 0.

    Raises:
        ValueError: `rewards` is not 1-D, is empty, is not real-valued, or holds NaN/inf;
            `eps` is not a finite number > 0.
    """
    r = _validated_rewards(rewards)
    if not (isinstance(eps, (int, float)) and np.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}; use e.g. eps=1e-6")
    if np.all(r == r[0]):
        # Also covers G == 1. Guarantees exact zeros: np.mean of equal floats can be off by 1 ulp.
        return np.zeros(r.shape, dtype=np.float32)
    centered = r - r.mean()
    if std_normalize:
        centered = centered / (r.std(ddof=0) + eps)
    return centered.astype(np.float32)


def _validated_rewards(rewards: np.ndarray) -> np.ndarray:
    """Return `rewards` as a `[group_size]` float64 array; ValueError names the problem and fix."""
    r = np.asarray(rewards)
    if r.dtype.kind not in "biuf":
        raise ValueError(
            f"rewards must be real numbers, got dtype {r.dtype}; pass a float array of shape [group_size]"
        )
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
