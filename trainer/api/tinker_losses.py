"""The Tinker API's losses over rlbus's loss family (:mod:`trainer.losses`): each is a per-token loss summed
over the call's tokens (Tinker's ``loss:sum``, not a mean), from the token logprobs ``[N]`` of the call's
targets and its named per-token inputs. The surrogates are rlbus's objective functions; Tinker's names and
parameters (https://tinker-docs.thinkingmachines.ai/losses) are mapped onto them here, once.
"""

from __future__ import annotations

import torch

from trainer.losses import aipo_token_loss, importance_sampling_token_loss, ppo_clip_token_loss

LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
}
"""Each loss and the ``loss_fn_inputs`` it needs (``weights`` of cross_entropy defaults to 1)."""


def token_loss(
    loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """``[N]`` float32 per-token loss of ``loss_fn`` (its sum is the call's loss); ``logprobs`` ``[N]`` of the
    targets under the trained policy (with a gradient), ``inputs`` the call's per-token inputs ``[N]``.

    Raises:
        ValueError: an unknown loss, or a loss input it needs is missing.
    """
    if loss_fn not in LOSS_INPUTS:
        raise ValueError(f"loss_fn {loss_fn!r} is not served; use one of {', '.join(LOSS_INPUTS)}")
    missing = [k for k in LOSS_INPUTS[loss_fn] if k not in inputs and k not in ("weights", "target_tokens")]
    if missing:
        raise ValueError(f"loss_fn {loss_fn!r} needs loss_fn_inputs {missing}")
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights", torch.ones_like(logprobs))
        return -weights * logprobs
    log_ratio = logprobs - inputs["logprobs"]
    advantages = inputs["advantages"]
    if loss_fn == "importance_sampling":
        return importance_sampling_token_loss(log_ratio, advantages)[0]
    low = float(config.get("clip_low_threshold", 0.8))
    high = float(config.get("clip_high_threshold", 1.2))
    if loss_fn == "ppo":  # Tinker's thresholds are ratios: eps_low = 1 - low, eps_high = high - 1
        return ppo_clip_token_loss(log_ratio, advantages, 1.0 - low, high - 1.0, None)[0]
    # cispo: -sg(clip(r, low, high)) A log pi (MiniMax-M1, arXiv:2506.13585, Eq. 4), AIPO's form with a clipped r
    ratio = torch.exp(log_ratio.detach()).clamp(low, high)
    return aipo_token_loss(logprobs, ratio, advantages)
