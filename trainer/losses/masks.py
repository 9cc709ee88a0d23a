"""Which loss tokens keep their gradient: the token, sample and IcePop masks on the mismatch ratio.

The mismatch ratio of a token is m_t = pi_train(y_t) / pi_rollout(y_t) (detached): how far the
trainer has moved from the sampler, by staleness (the rollout is several optimizer steps old) and
by numerics (the inference engine differs from the trainer even at the same weights). A token or a
whole sample whose ratio is implausible is masked: it gets exactly zero gradient, rather than a
clipped one (masking, not clipping, follows prime-rl and IcePop).

Every mask is decided in float64, and a NaN ratio fails every bound, so it is masked.
"""

from __future__ import annotations

import math

import torch

from trainer.losses.spec import LossSpec

__all__ = ["geo_mean_mask", "icepop_mask", "keep_mask", "ratio_in_bounds", "sequence_extreme_mask"]


def ratio_in_bounds(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """`low <= exp(log_ratio) <= high`, elementwise in float64 (bounds inclusive; NaN -> False).

    Args:
        log_ratio: any shape, float, nats.
        low, high: ratio bounds (high may be inf).

    Returns:
        bool, same shape.
    """
    ratio = torch.exp(log_ratio.double())
    return (ratio >= low) & (ratio <= high)


def geo_mean_mask(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int, low: float, high: float
) -> torch.Tensor:
    """Per token: is its sample's geometric-mean ratio exp(mean_{u in i, loss_mask} log m_u) in [low, high]?

    A sample with no loss token has geometric mean 1. Source: prime-rl's `geo_mask_low/high`
    (src/prime_rl/trainer/rl/loss.py, `geo_seq_ratio = exp(mean(log_importance_ratio over loss_mask))`).

    Args:
        log_ratio: `[T]` float, log m_t (detached).
        loss_mask: `[T]` bool.
        seq_ids: `[T]` int64 sample index of each token.
        num_samples: S.
        low, high: bounds on the geometric mean.

    Returns:
        `[T]` bool (the sample's verdict broadcast to its tokens).
    """
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
    """Per token: are ALL its sample's loss-token ratios within [low, high] (min >= low and max <= high)?

    One implausible token condemns the whole sample. None disables a side. Source: prime-rl's
    `sequence_mask_low/high` ("masks entire sequences when any generated token has an importance
    ratio below/above this value", src/prime_rl/trainer/rl/config.py).

    Args:
        log_ratio, loss_mask, seq_ids, num_samples: as `geo_mean_mask`.
        low: smallest allowed token ratio, or None.
        high: largest allowed token ratio, or None.

    Returns:
        `[T]` bool.
    """
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
    """IcePop hard mask: keep a token only if its mismatch ratio lies in [1/beta, beta].

    Source: Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale
    Thinking Model" (Ring-1T, arXiv:2510.18855), IcePop: the token's gradient is kept only when
    pi_train(y_t)/pi_infer(y_t) lies in [alpha, beta] (the paper's masking function M). Here alpha =
    1/beta. IcePop also weights kept tokens by that ratio; that is `LossSpec.use_tis` with wide clip
    bounds, kept separate.

    Args:
        log_ratio: `[T]` float, log m_t (detached).
        beta: > 1.

    Returns:
        `[T]` bool.
    """
    return ratio_in_bounds(log_ratio, 1.0 / beta, beta)


def keep_mask(
    log_ratio: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int, spec: LossSpec
) -> torch.Tensor:
    """The tokens whose loss (and gradient) counts: `loss_mask` and every mask `spec` turns on.

    aipo: token mask [token_mask_low, token_mask_high], geometric-mean sample mask
    [geo_mask_low, geo_mask_high], extreme-token sample mask [sequence_mask_low, sequence_mask_high].
    Any type: IcePop mask when icepop_beta is set.

    Args:
        log_ratio: `[T]` float, detached log mismatch ratio train_logprobs - sampler_logprobs (nats).
        loss_mask: `[T]` bool.
        seq_ids: `[T]` int64 sample of each token.
        num_samples: S.
        spec: the loss choice.

    Returns:
        `[T]` bool, a subset of loss_mask.
    """
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
