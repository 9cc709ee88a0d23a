"""Per-token policy-gradient surrogates of the four loss types, each one small pure function.

Each returns `(token_loss [T], clipped [T] bool)`: the surrogate loss of every token (to be
aggregated by `trainer.losses.aggregation`) and where a clip removed the token's gradient.
Notation: A_t = the token's (already scaled) advantage, detached; r_t = pi(y_t) / pi_b(y_t) the
policy ratio against the behaviour policy b (the sampler, or pi_old under TIS); eps_low / eps_high
the clip range. The gradient w.r.t. train_logprobs[t] is written in each docstring.

Inputs must already be sanitized by the caller (`trainer.losses.policy`): on masked tokens the
log-ratio is 0 and A_t is 0, so no inf/NaN reaches exp() or a product whose gradient would be
0 * inf = NaN.
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
    """exp(log_ratio) with log_ratio clamped to +-LOG_RATIO_BOUND (no gradient beyond the clamp)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def aipo_token_loss(train_logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """AIPO / prime-rl token loss: `-sg(r_t * A_t) * log pi_train(y_t)`.

    The coefficient is detached, so d loss_t / d train_logprobs[t] = -r_t * A_t: the importance-weighted
    policy gradient E_{y~pi_b}[r * A * grad log pi]. Sources: AIPO in LlamaRL (Wu et al. 2025,
    arXiv:2505.24034, importance weights against the *inference* logprobs); prime-rl's
    `default_loss_fn` (src/prime_rl/trainer/rl/loss.py: `loss = -(coeff.detach() * trainer_logprobs)`).

    Args:
        train_logprobs: `[T]` float, log pi_train with grad (0 on masked tokens).
        ratio: `[T]` float, detached weight r_t (token ratio, or the sample's clipped sequence ratio).
        advantages: `[T]` float, detached A_t.

    Returns:
        `[T]` token loss, dtype of train_logprobs.
    """
    coeff = (ratio * advantages).detach()
    return -coeff * train_logprobs


def clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate `max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))` and where the clip is active.

    The clipped branch has zero gradient, so d loss / d r = -A where not clipped, 0 where clipped
    (clipped = the clipped branch is strictly larger: r > 1 + eps_high with A > 0, or r < 1 - eps_low
    with A < 0). Source: Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
    arXiv:1707.06347, Eq. 7; asymmetric bounds ("clip-higher") as in DAPO (arXiv:2503.14476) and
    verl's `compute_policy_loss_vanilla` (clip_ratio_low/high).

    Args:
        ratio: `[T]` float, r (with grad).
        advantages: `[T]` float, detached A.
        eps_low, eps_high: clip range, 0 < eps_low < 1, eps_high > 0.

    Returns:
        (`[T]` loss, `[T]` bool clipped).
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = clipped_loss > unclipped
    return torch.where(clipped, clipped_loss, unclipped), clipped


def ppo_clip_token_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float, eps_c: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip token loss, with optional dual clip for negative advantages.

    loss_t = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)), and when eps_c is set and A < 0,
    loss_t = min(loss_t, -A * eps_c) (Ye et al. 2020, "Mastering Complex Control in MOBA Games with
    Deep RL", arXiv:1912.09729, dual-clip PPO; verl `clip_ratio_c`, default 3). With r = exp(log_ratio):
    d loss_t / d train_logprobs[t] = -A r where no clip is active, else 0.

    Args:
        log_ratio: `[T]` float, train_logprobs - lp_b (with grad), 0 on masked tokens.
        advantages: `[T]` float, detached A.
        eps_low, eps_high: clip range.
        eps_c: dual-clip constant > 1, or None.

    Returns:
        (`[T]` loss, `[T]` bool: the PPO clip or the dual clip is active).
    """
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
    """Plain importance-sampled policy gradient, no clipping: `loss_t = -(r_t * A_t)`.

    d loss_t / d train_logprobs[t] = -A r (the gradient of the unclipped PPO surrogate; Schulman et al.
    2017, arXiv:1707.06347, L^CPI Eq. 6; Kakade & Langford 2002).

    Args:
        log_ratio: `[T]` float, train_logprobs - lp_b (with grad), 0 on masked tokens.
        advantages: `[T]` float, detached A.

    Returns:
        (`[T]` loss, `[T]` bool all False).
    """
    return -advantages * _ratio(log_ratio), torch.zeros_like(advantages, dtype=torch.bool)


def gspo_token_loss(
    train_logprobs: torch.Tensor, seq_log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO token loss in its GSPO-token form, clipped at the sequence level.

    s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], with s_i = exp(mean_t log r_t) the sample's
    geometric-mean ratio (`sequence_mean_log_ratio`), so s_{i,t} equals s_i in value and
    d s_{i,t} / d lp[t] = s_i. Then loss_t = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_low, 1 + eps_high)),
    d loss_t / d train_logprobs[t] = -A s_i when the sample is not clipped, else 0. With one advantage per
    sample and aggregation "seq_mean_token_mean" this is GSPO's objective and gradient exactly.
    Source: Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071, Eqs. 5-7
    (GSPO) and 11-12 (GSPO-token); the paper's clip range is eps_low = 3e-4, eps_high = 4e-4.

    Args:
        train_logprobs: `[T]` float, log pi_train with grad (finite; 0 on masked tokens).
        seq_log_ratio: `[T]` float, detached log s_i of the token's sample, 0 on masked tokens.
        advantages: `[T]` float, detached A.
        eps_low, eps_high: clip range.

    Returns:
        (`[T]` loss, `[T]` bool clipped).
    """
    log_s = seq_log_ratio.detach().clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND) + train_logprobs - train_logprobs.detach()
    return clipped_surrogate(torch.exp(log_s), advantages, eps_low, eps_high)
