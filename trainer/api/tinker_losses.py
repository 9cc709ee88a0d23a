"""The API's losses over rlbus's loss family (:mod:`trainer.losses`): each is a per-token loss summed over the
call's tokens (Tinker's ``loss:sum``, not a mean), from the targets' logprobs ``[N]`` under the trained policy
and the call's named per-token inputs. Tinker's names and parameters (https://tinker-docs.thinkingmachines.ai/
losses) and xorl's ``policy_loss`` are mapped onto rlbus's objective functions and ``policy_loss_terms`` here,
once; ``tests/service/test_losses.py`` checks each against them on the same tensors.
"""

from __future__ import annotations

import torch

from trainer.losses import (
    LossBatch,
    LossSpec,
    StepNorm,
    aipo_token_loss,
    importance_sampling_token_loss,
    kl_k2,
    kl_k3,
    policy_loss_terms,
    ppo_clip_token_loss,
    stats_to_floats,
)

LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
    "policy_loss": ("advantages",),
}
"""Each served loss and the ``loss_fn_inputs`` it needs besides the targets (``target_tokens``, or xorl's
``labels``); cross_entropy's ``weights`` default to 1, policy_loss takes ``logprobs`` and/or
``rollout_logprobs``."""


def token_loss(
    loss_fn: str,
    logprobs: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    config: dict[str, float],
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``([N] float32 per-token loss, metrics)`` of ``loss_fn``; its sum is the call's loss. ``logprobs`` ``[N]``
    (with a gradient), ``inputs`` ``{name: [N]}``, ``seq_lens`` ``[D]`` the datums' lengths (sum N).

    Raises:
        ValueError: an unknown loss, or a loss input it needs is missing.
    """
    if loss_fn not in LOSS_INPUTS:
        raise ValueError(f"loss_fn {loss_fn!r} is not served; use one of {', '.join(LOSS_INPUTS)}")
    missing = [k for k in LOSS_INPUTS[loss_fn] if k not in inputs]
    if missing:
        raise ValueError(f"loss_fn {loss_fn!r} needs loss_fn_inputs {missing}")
    if loss_fn == "cross_entropy":
        return -inputs.get("weights", torch.ones_like(logprobs)) * logprobs, {}
    if loss_fn == "policy_loss":
        return xorl_policy_loss(logprobs, inputs, config, seq_lens)
    log_ratio = logprobs - inputs["logprobs"]
    adv = inputs["advantages"]
    low = float(config.get("clip_low_threshold", 0.8))
    high = float(config.get("clip_high_threshold", 1.2))
    if loss_fn == "importance_sampling":  # -r A (PPO's L^CPI)
        return importance_sampling_token_loss(log_ratio, adv)[0], {}
    if loss_fn == "ppo":  # Tinker's thresholds are ratios: eps_low = 1 - low, eps_high = high - 1
        return ppo_clip_token_loss(log_ratio, adv, 1.0 - low, high - 1.0, None)[0], {}
    if loss_fn == "cispo":  # -sg(clip(r, low, high)) A log pi (MiniMax-M1, arXiv:2506.13585, Eq. 4): AIPO's form
        return aipo_token_loss(logprobs, torch.exp(log_ratio.detach()).clamp(low, high), adv), {}
    if loss_fn == "dro":  # -(A log pi - beta/2 (log pi - log pi_b)^2) (Richemond et al. 2024): k2 is the square
        return -adv * logprobs + float(config.get("beta", 0.05)) * kl_k2(log_ratio), {}
    # gspo: the sample's geometric-mean ratio over its tokens with a logprob or an advantage (prompt tokens have
    # neither), clipped at [low, high] (Zheng et al. 2025): rlbus's gspo through policy_loss_terms
    mask = (inputs["logprobs"] != 0) | (adv != 0)
    spec = LossSpec(
        type="gspo",
        eps_clip=1.0 - low,
        eps_clip_high=high - 1.0,
        token_mask_low=0.0,
        token_mask_high=float("inf"),
        geo_mask_low=0.0,
        geo_mask_high=float("inf"),
    )
    return _per_token(spec, logprobs, inputs["logprobs"], adv, mask, seq_lens, None)


def xorl_policy_loss(
    logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float], seq_lens: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """xorl-client's ``policy_loss`` (PPO-clip with ``eps_clip``, ``eps_clip_high``, dual clip ``eps_clip_c``,
    IcePop ``icepop_beta``, TIS ``use_tis``/``tis_clip_low``/``tis_clip_high``) as rlbus's ``ppo_clip`` spec:
    with TIS, pi_old = ``logprobs`` and the rollout = ``rollout_logprobs``; without, the ratio's denominator is
    ``logprobs`` (else ``rollout_logprobs``). Tokens whose label is < 0 (-100) are masked. Metrics: xorl's names."""
    rollout = inputs.get("rollout_logprobs", inputs.get("logprobs"))
    old = inputs.get("logprobs", rollout)
    if rollout is None:
        raise ValueError("policy_loss needs loss_fn_inputs logprobs or rollout_logprobs")
    use_tis = bool(config.get("use_tis", False))
    beta = config.get("icepop_beta")
    spec = LossSpec(
        type="ppo_clip",
        eps_clip=float(config.get("eps_clip", 0.2)),
        eps_clip_high=float(config["eps_clip_high"]) if config.get("eps_clip_high") is not None else None,
        eps_clip_c=float(config["eps_clip_c"]) if config.get("eps_clip_c") is not None else None,
        icepop_beta=float(beta) if beta else None,
        use_tis=use_tis,
        tis_clip_low=float(config.get("tis_clip_low", 0.0)),
        tis_clip_high=float(config.get("tis_clip_high", 2.0)),
        token_mask_low=0.0,
        token_mask_high=float("inf"),
        geo_mask_low=0.0,
        geo_mask_high=float("inf"),
    )
    mask = inputs["labels_mask"] if "labels_mask" in inputs else torch.ones_like(logprobs, dtype=torch.bool)
    sampler = rollout if use_tis else old
    per_token, stats = _per_token(
        spec, logprobs, sampler, inputs["advantages"], mask, seq_lens, old if use_tis else None
    )
    n = max(stats["loss_tokens"], 1.0)
    log_r = torch.where(mask, logprobs.detach() - rollout, 0.0)
    metrics = {
        "pg_clipfrac:mean": stats["clipped_tokens"] / n,
        "icepop_maskfrac:mean": stats["masked_tokens"] / n,
        "ratio_mean:mean": stats["ratio_sum"] / n,
        "ratio_min:min": stats["ratio_min"],
        "ratio_max:max": stats["ratio_max"],
        "kl_sample_train_k3:mean": float(torch.where(mask, kl_k3(-log_r), 0.0).sum()) / n,
    }
    return per_token, metrics


def _per_token(
    spec: LossSpec,
    logprobs: torch.Tensor,
    sampler: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    seq_lens: torch.Tensor,
    old: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """rlbus's ``policy_loss_terms`` (``token_mean``) times the call's loss tokens: the sum of its token losses,
    as a ``[N]`` vector whose sum it is (sequence-coupled losses have no honest per-token split)."""
    batch = LossBatch(
        train_logprobs=logprobs,
        sampler_logprobs=sampler,
        advantages=adv,
        loss_mask=mask,
        seq_lens=seq_lens,
        old_logprobs=old,
    )
    tokens = max(int(mask.sum()), 1)  # token_mean over the call's tokens, times their number: the sum
    norm = StepNorm(loss_tokens=tokens, num_samples=max(int(seq_lens.numel()), 1), max_tokens=1)
    loss, stats = policy_loss_terms(batch, norm, spec)
    return _spread(loss * tokens, mask), stats_to_floats(stats)


def _spread(loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` whose sum is ``loss`` (its gradient too): the whole loss on the first token, 0 elsewhere."""
    out = torch.zeros(mask.shape, dtype=loss.dtype, device=loss.device)
    return out.index_put((torch.zeros(1, dtype=torch.long, device=loss.device),), loss.reshape(1)) if len(mask) else out
