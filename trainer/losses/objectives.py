"""Per-token surrogates of the four loss types, each `(token_loss [T], clipped [T] bool)`.

A is the token's advantage (detached), r = pi(y_t) / pi_b(y_t) against the behaviour policy. Inputs
come sanitized (`trainer.losses.policy`): on masked tokens the log-ratio and A are 0.
"""

from __future__ import annotations

import torch

from trainer.losses.estimators import LOG_RATIO_BOUND

__all__ = [
    "aipo_token_loss",
    "clipped_surrogate",
    "gspo_token_loss",
    "importance_sampling_token_loss",
    "ppo_clip_token_loss",
]


def _ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) with log_ratio clamped to +-LOG_RATIO_BOUND."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def aipo_token_loss(train_logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """`-sg(r A) log pi_train`, gradient `-r A`: AIPO (LlamaRL, arXiv:2505.24034) as prime-rl's `default_loss_fn`."""
    coeff = (ratio * advantages).detach()
    return -coeff * train_logprobs


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))` and where the clipped branch wins (PPO,
    arXiv:1707.06347, Eq. 7; asymmetric as in DAPO, arXiv:2503.14476).
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = clipped_loss > unclipped
    return torch.where(clipped, clipped_loss, unclipped), clipped


def ppo_clip_token_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, eps_c: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip of `exp(log_ratio)` capped at `-A eps_c` if A < 0 (dual clip, arXiv:1912.09729; verl `clip_ratio_c`)."""
    loss, clipped = clipped_surrogate(_ratio(log_ratio), advantages, eps_low, eps_high)
    if eps_c is not None:
        cap = -advantages * eps_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        clipped = clipped | dual
    return loss, clipped


def importance_sampling_token_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`-(r A)` without clipping (PPO's L^CPI, arXiv:1707.06347, Eq. 6); nothing clipped."""
    return -advantages * _ratio(log_ratio), torch.zeros_like(advantages, dtype=torch.bool)


def gspo_token_loss(
    train_logprobs: torch.Tensor, seq_log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO-token: the clipped surrogate of `s_{i,t} = sg[s_i] pi(y_t) / sg[pi(y_t)]`, s_i from `seq_log_ratio`;
    gradient `-A s_i` unless clipped (Zheng et al. 2025, arXiv:2507.18071, Eqs. 11-12).
    """
    log_s = seq_log_ratio.detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) + train_logprobs - train_logprobs.detach()
    return clipped_surrogate(torch.exp(log_s), advantages, eps_low, eps_high)
