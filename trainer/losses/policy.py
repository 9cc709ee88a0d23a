"""`policy_loss`: one packed micro-batch's share of the step's policy loss, and its loss statistics.

Per token (ratios detached unless said):
    m_t  = pi_train / pi_rollout                          mismatch ratio: masks, stats
    keep = loss_mask & masks(m)                           `trainer.losses.masks.keep_mask`
    r_t  = pi_train / pi_b,  b = old if use_tis else rollout
    A'_t = adv_tau A_t + teacher_tau (teacher_logprobs - train_logprobs)
    l_t  = tis_weight_t surrogate(r, A')_t + kl_tau k(train, ref)_t on kept tokens, else 0
    loss = sum_t weight_t l_t                             `trainer.losses.aggregation`
A token outside `keep` gets exactly zero gradient, whatever its inputs.
"""

from __future__ import annotations

import math

import torch

from trainer.losses.aggregation import aggregate_token_loss
from trainer.losses.checks import check_loss_inputs
from trainer.losses.estimators import (
    LOG_RATIO_BOUND,
    kl_penalty,
    mismatch_kl,
    sample_ids,
    sequence_mean_log_ratio,
    sequence_sum_log_ratio,
    tis_weight,
)
from trainer.losses.masks import keep_mask
from trainer.losses.objectives import (
    aipo_token_loss,
    gspo_token_loss,
    importance_sampling_token_loss,
    ppo_clip_token_loss,
)
from trainer.losses.spec import LossBatch, LossSpec, StepNorm

__all__ = ["policy_loss", "policy_loss_terms", "stats_to_floats"]


def policy_loss(batch: LossBatch, norm: StepNorm, spec: LossSpec) -> tuple[torch.Tensor, dict[str, float]]:
    """(0-dim loss, differentiable w.r.t. `batch.train_logprobs`; stats as floats) of one micro-batch.

    Stats are sums or min/max over loss tokens: `loss_tokens`, `masked_tokens`, `clipped_tokens`,
    `kl_sum` (k3 of KL(rollout || train), nats), `ratio_sum/min/max` (of m); when their option is on,
    `kl_penalty_sum`, `tis_clipped_tokens`, `teacher_kl_sum`, `entropy_sum`.

    Raises:
        ValueError: seq_lens not splitting T, a norm below the micro-batch's counts, a missing input
            the spec needs, or an input not finite on a loss token.
    """
    loss, stats = policy_loss_terms(batch, norm, spec)
    return loss, stats_to_floats(stats)


def policy_loss_terms(batch: LossBatch, norm: StepNorm, spec: LossSpec) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` with the stats as 0-dim float64 device tensors (for `stats_to_floats`); no host sync
    when `batch.checked`.
    """
    seq_ids = sample_ids(batch.seq_lens, batch.num_tokens, checked=batch.checked)
    num_samples = int(batch.seq_lens.numel())
    loss_mask = batch.loss_mask
    _check_inputs(batch, spec, norm)
    train_logprobs = batch.train_logprobs
    dtype, zero = train_logprobs.dtype, torch.zeros((), dtype=train_logprobs.dtype, device=train_logprobs.device)
    mismatch = train_logprobs.detach() - batch.sampler_logprobs.to(dtype)
    keep = keep_mask(mismatch, loss_mask, seq_ids, num_samples, spec)

    lp_behaviour = (batch.old_logprobs if spec.use_tis else batch.sampler_logprobs).detach().to(dtype)
    log_ratio = torch.where(keep, train_logprobs - lp_behaviour, zero)  # grad flows; 0 where not kept
    lp_kept = torch.where(keep, train_logprobs, zero)
    adv = spec.adv_tau * batch.advantages.to(dtype)
    if spec.teacher_tau > 0:
        adv = adv + spec.teacher_tau * (batch.teacher_logprobs.to(dtype) - train_logprobs.detach())
    adv = torch.where(keep, adv, zero).detach()

    if spec.type == "aipo":
        raw = train_logprobs.detach() - lp_behaviour
        token_loss, clipped = _aipo(spec, lp_kept, raw, adv, loss_mask, keep, seq_ids, num_samples)
    elif spec.type == "ppo_clip":
        token_loss, clipped = ppo_clip_token_loss(log_ratio, adv, spec.eps_clip, spec.clip_high, spec.eps_clip_c)
    elif spec.type == "importance_sampling":
        token_loss, clipped = importance_sampling_token_loss(log_ratio, adv)
    else:  # gspo: the sample's geometric-mean ratio over its kept tokens
        seq_lr = sequence_mean_log_ratio(log_ratio.detach(), keep, seq_ids, num_samples)[seq_ids]
        token_loss, clipped = gspo_token_loss(
            lp_kept, torch.where(keep, seq_lr, zero), adv, spec.eps_clip, spec.clip_high
        )

    extra: dict[str, torch.Tensor] = {}
    if spec.use_tis:
        weight = tis_weight(batch.old_logprobs.to(dtype), batch.sampler_logprobs, spec.tis_clip_low, spec.tis_clip_high)
        token_loss = torch.where(keep, weight, zero) * token_loss
        raw_weight = torch.exp(batch.old_logprobs.double() - batch.sampler_logprobs.double())
        extra["tis_clipped_tokens"] = (
            keep & ((raw_weight < spec.tis_clip_low) | (raw_weight > spec.tis_clip_high))
        ).sum()
    if spec.kl_tau > 0:
        ref_logprobs = batch.sampler_logprobs if spec.kl_reference == "rollout" else batch.ref_logprobs
        penalty = kl_penalty(lp_kept, torch.where(keep, ref_logprobs.to(dtype), zero), spec.kl_estimator)
        penalty = torch.where(keep, penalty, zero)
        token_loss = token_loss + spec.kl_tau * penalty
        extra["kl_penalty_sum"] = penalty.detach().double().sum()
    if batch.teacher_logprobs is not None:
        teacher_kl = train_logprobs.detach().double() - batch.teacher_logprobs.double()
        extra["teacher_kl_sum"] = torch.where(loss_mask, teacher_kl, 0.0).sum()
    if batch.entropy is not None:
        extra["entropy_sum"] = torch.where(loss_mask, batch.entropy.detach().double(), 0.0).sum()

    loss = aggregate_token_loss(token_loss, loss_mask, seq_ids, num_samples, norm, spec.aggregation)
    return loss, _stats(mismatch, loss_mask, keep, clipped, extra)


def _aipo(
    spec: LossSpec,
    lp_kept: torch.Tensor,
    raw_log_ratio: torch.Tensor,
    adv: torch.Tensor,
    loss_mask: torch.Tensor,
    keep: torch.Tensor,
    seq_ids: torch.Tensor,
    num_samples: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """aipo's loss, weighted by the token ratio or the sample's product ratio (over loss_mask, as prime-rl)
    clipped at sequence_clip_high.
    """
    zero = torch.zeros((), dtype=lp_kept.dtype, device=lp_kept.device)
    if spec.ratio_type == "token":
        ratio = torch.exp(torch.where(keep, raw_log_ratio, zero).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        return aipo_token_loss(lp_kept, torch.where(keep, ratio, zero), adv), torch.zeros_like(keep)
    seq_lr = sequence_sum_log_ratio(raw_log_ratio, loss_mask, seq_ids, num_samples)
    cap = math.log(spec.sequence_clip_high)
    clipped = (seq_lr > cap)[seq_ids] & keep
    ratio = torch.exp(seq_lr.clamp(max=cap))[seq_ids]
    return aipo_token_loss(lp_kept, torch.where(keep, ratio, zero), adv), clipped


def _check_inputs(batch: LossBatch, spec: LossSpec, norm: StepNorm) -> None:
    """Inputs the spec reads must be present; unless `batch.checked`, checked on host copies (a sync)."""
    needed = {"sampler_logprobs": batch.sampler_logprobs, "advantages": batch.advantages}
    requirements = (
        (
            "old_logprobs",
            spec.use_tis,
            "use_tis needs the old-policy logprobs (old_logprobs = train_logprobs.detach() for one step per batch)",
        ),
        (
            "ref_logprobs",
            spec.kl_tau > 0 and spec.kl_reference == "reference",
            "kl_reference='reference' needs the reference model's logprobs",
        ),
        (
            "teacher_logprobs",
            spec.teacher_tau > 0,
            "teacher_tau > 0 needs the samples' teacher logprobs; set teacher_tau=0 or fetch them",
        ),
    )
    for name, required, why in requirements:
        tensor = getattr(batch, name)
        if required and tensor is None:
            raise ValueError(f"LossBatch.{name} is None: {why}")
        if tensor is not None and (required or name == "teacher_logprobs"):
            needed[name] = tensor
    if batch.checked:
        return

    def host(t: torch.Tensor):
        return t.detach().cpu().numpy()

    check_loss_inputs(host(batch.loss_mask), host(batch.seq_lens), norm, {name: host(t) for name, t in needed.items()})


def _stats(
    mismatch: torch.Tensor,
    loss_mask: torch.Tensor,
    keep: torch.Tensor,
    clipped: torch.Tensor,
    extra: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Sums/min/max over loss tokens as 0-dim float64 tensors, via `where` (no boolean-mask indexing)."""
    lr = torch.where(loss_mask, mismatch.double(), 0.0)
    ratio = torch.exp(lr)
    base = {
        "loss_tokens": loss_mask.sum(),
        "masked_tokens": (loss_mask & ~keep).sum(),
        "clipped_tokens": (clipped & keep).sum(),
        "kl_sum": torch.where(loss_mask, mismatch_kl(lr), 0.0).sum(),
        "ratio_sum": torch.where(loss_mask, ratio, 0.0).sum(),
        "ratio_min": torch.where(loss_mask, ratio, math.inf).amin() if lr.numel() else lr.new_tensor(math.inf),
        "ratio_max": torch.where(loss_mask, ratio, -math.inf).amax() if lr.numel() else lr.new_tensor(-math.inf),
    }
    base.update(extra)
    return {name: value.double().reshape(()) for name, value in base.items()}


def stats_to_floats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """`{name: 0-dim tensor}` -> `{name: float}` with one host sync (one stack, one `tolist`)."""
    if not stats:
        return {}
    values = torch.stack([value.double().reshape(()) for value in stats.values()]).tolist()
    return dict(zip(stats.keys(), values))
