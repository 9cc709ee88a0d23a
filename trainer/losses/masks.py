"""Which loss tokens keep their gradient: token, sample and IcePop masks on the mismatch ratio.

m_t = pi_train(y_t) / pi_rollout(y_t), detached, grows with staleness and engine numerics. A token or
sample with an implausible ratio is masked (zero gradient, not clipped, as prime-rl and IcePop do),
decided in float64; a NaN ratio fails every bound.
"""

from __future__ import annotations

import math

import torch

from trainer.losses.spec import LossSpec

__all__ = ["geo_mean_mask", "icepop_mask", "keep_mask", "ratio_in_bounds", "sequence_extreme_mask"]


def ratio_in_bounds(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """`low <= exp(log_ratio) <= high` elementwise in float64 (NaN -> False)."""
    ratio = torch.exp(log_ratio.double())
    return (ratio >= low) & (ratio <= high)


def geo_mean_mask(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int, low: float, high: float
) -> torch.Tensor:
    """`[T]` bool: the sample's geometric-mean loss-token ratio is in [low, high] (prime-rl's `geo_mask_low/high`)."""
    lr = torch.where(loss_mask, log_ratio.double(), 0.0)
    zeros = torch.zeros(num_samples, dtype=torch.float64, device=log_ratio.device)
    mean = zeros.index_add(0, seq_ids, lr) / zeros.index_add(0, seq_ids, loss_mask.double()).clamp(min=1.0)
    return ratio_in_bounds(mean, low, high)[seq_ids]


def sequence_extreme_mask(
    log_ratio: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_samples: int,
    low: float | None,
    high: float | None,
) -> torch.Tensor:
    """`[T]` bool: all the sample's loss-token ratios are in [low, high], None: off (prime-rl's `sequence_mask_*`)."""
    ok = torch.ones(num_samples, dtype=torch.bool, device=log_ratio.device)
    if low is None and high is None:
        return ok[seq_ids]
    # a token outside [low, high] (or NaN) marks its sample bad: count bad loss tokens per sample
    bad = loss_mask & ~ratio_in_bounds(log_ratio, 0.0 if low is None else low, math.inf if high is None else high)
    bad_per_sample = torch.zeros(num_samples, dtype=torch.int64, device=log_ratio.device).index_add(
        0, seq_ids, bad.long()
    )
    return (bad_per_sample == 0)[seq_ids]


def icepop_mask(log_ratio: torch.Tensor, beta: float) -> torch.Tensor:
    """`[T]` bool: the ratio lies in [1/beta, beta] (IcePop: Ring-1T, arXiv:2510.18855)."""
    return ratio_in_bounds(log_ratio, 1.0 / beta, beta)


def keep_mask(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int, spec: LossSpec
) -> torch.Tensor:
    """`[T]` bool, a subset of `loss_mask`: the tokens that pass every mask `spec` turns on."""
    keep = loss_mask.clone()
    if spec.type == "aipo":
        keep &= ratio_in_bounds(log_ratio, spec.token_mask_low, spec.token_mask_high)
        keep &= geo_mean_mask(log_ratio, loss_mask, seq_ids, num_samples, spec.geo_mask_low, spec.geo_mask_high)
        keep &= sequence_extreme_mask(
            log_ratio, loss_mask, seq_ids, num_samples, spec.sequence_mask_low, spec.sequence_mask_high
        )
    if spec.icepop_beta is not None:
        keep &= icepop_mask(log_ratio, spec.icepop_beta)
    return keep
