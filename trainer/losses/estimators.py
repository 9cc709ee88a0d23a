"""Small pure formulas the policy losses are built from: KL estimators, sample-level ratios, the
TIS weight, and the token -> sample bookkeeping of packed micro-batches.

Conventions: every tensor is flat `[T]` (packed tokens) or `[S]` (samples); log-probabilities and
log-ratios are in nats. A "log ratio" log r = log p(y) - log q(y) compares two policies on the same
sampled token y.

Invariant: nothing here reads outside the tokens selected by a mask, so -inf/NaN on prompt
tokens never leaks into a result that is selected by the mask.
"""

from __future__ import annotations

import torch

from trainer.forward.packed import validated_seq_lens

__all__ = [
    "LOG_RATIO_BOUND",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "mismatch_kl",
    "sample_ids",
    "segment_sum",
    "sequence_mean_log_ratio",
    "sequence_sum_log_ratio",
    "tis_weight",
]

# |log ratio| beyond this is clamped before exp() in the policy losses and the k3 penalty (e^20 ~ 4.9e8),
# as verl does ("Clamp negative_approx_kl for stability", verl/trainer/ppo/core_algos.py,
# compute_policy_loss_vanilla and kl_penalty "low_var_kl"); the clamp stops the gradient there.
LOG_RATIO_BOUND = 20.0


def kl_k1(log_r: torch.Tensor) -> torch.Tensor:
    """k1 estimator of KL(q || p): `-log r`, with log r = log p(x) - log q(x) and x ~ q.

    Unbiased, high variance, can be negative. Source: J. Schulman, "Approximating KL Divergence"
    (2020), http://joschu.net/blog/kl-approx.html.

    Args:
        log_r: any shape, float; nats.

    Returns:
        Same shape and dtype; nats.
    """
    return -log_r


def kl_k2(log_r: torch.Tensor) -> torch.Tensor:
    """k2 estimator of KL(q || p): `(log r)^2 / 2`, x ~ q. Biased (low for close p, q), >= 0, low variance.

    Source: Schulman, http://joschu.net/blog/kl-approx.html.
    """
    return 0.5 * log_r.square()


def kl_k3(log_r: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(q || p): `(r - 1) - log r`, x ~ q. Unbiased, >= 0, low variance.

    Written with expm1 so it is exact near r = 1. Source: Schulman,
    http://joschu.net/blog/kl-approx.html (verl calls it "low_var_kl").
    """
    return torch.expm1(log_r) - log_r


_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(train_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL penalty estimating KL(pi_train || pi_ref), differentiable w.r.t. train_logprobs.

    With q = pi_train (the policy being penalized, treated as the sampler) and p = pi_ref, log r =
    ref_logprobs - train_logprobs:
        k1 = train_logprobs - ref_logprobs                       d/d train_logprobs = 1
        k2 = (train_logprobs - ref_logprobs)^2 / 2               d/d train_logprobs = train_logprobs - ref_logprobs
        k3 = exp(ref_logprobs - train_logprobs) - 1 - (ref_logprobs - train_logprobs)
                                                     d/d train_logprobs = 1 - exp(ref_logprobs - train_logprobs)
    For k3, log r is first clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] (verl's clamp). These are
    verl's `kl_penalty` "k1"/"k2"/"k3" (a.k.a. "kl"/"mse"/"low_var_kl", verl/trainer/ppo/core_algos.py),
    from Schulman, http://joschu.net/blog/kl-approx.html.

    Args:
        train_logprobs: `[T]` float, the trainer's logprobs (grad flows); nats.
        ref_logprobs: `[T]` float, the reference policy's logprobs (detached: the sampler or a frozen model).
        estimator: "k1" | "k2" | "k3".

    Returns:
        `[T]`, dtype of train_logprobs; nats.

    Raises:
        ValueError: unknown estimator.
    """
    if estimator not in _ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {', '.join(_ESTIMATORS)}; got {estimator!r}")
    log_r = ref_logprobs.detach().to(train_logprobs.dtype) - train_logprobs
    if estimator == "k3":
        log_r = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return _ESTIMATORS[estimator](log_r)


def mismatch_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_rollout || pi_train), the reported train/inference KL metric.

    Tokens are sampled by pi_rollout (q) and log_ratio = train_logprobs - sampler_logprobs = log p - log q, so
    this is exactly Schulman's k3 with r = pi_train / pi_rollout: `r - 1 - log r` (>= 0, 0 on-policy).

    Args:
        log_ratio: `[T]` float, train_logprobs - sampler_logprobs (nats, detached).

    Returns:
        `[T]` same dtype, >= 0; nats.
    """
    return kl_k3(log_ratio)


def sample_ids(seq_lens: torch.Tensor, num_tokens: int, *, checked: bool = False) -> torch.Tensor:
    """Index of the packed sample each token belongs to.

    Args:
        seq_lens: `[S]` integer tensor, lengths >= 1 of the packed samples, in packing order.
        num_tokens: T, the packed length.
        checked: the caller checked seq_lens on the host (`trainer.forward.packed_row.check_seq_lens`):
            skip the checks here, which read the lengths back from the device (a host sync).

    Returns:
        `[T]` int64 on seq_lens' device, e.g. seq_lens [2, 3] -> [0, 0, 1, 1, 1].

    Raises:
        ValueError: seq_lens is not a non-empty 1-D integer tensor of values >= 1 summing to T.
    """
    lens = seq_lens.long() if checked else validated_seq_lens(seq_lens)
    if not checked and int(lens.sum()) != num_tokens:
        raise ValueError(f"seq_lens must sum to the packed length {num_tokens}, got sum {int(lens.sum())}")
    # output_size: the result's length is known, so no device read to size it
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=num_tokens)


def segment_sum(values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int) -> torch.Tensor:
    """Per-sample sum of `values` over the tokens where `mask`: `out[i] = sum_{t in i, mask[t]} values[t]`.

    Unselected tokens are replaced by 0 before summing, so their inf/NaN never leak.

    Args:
        values: `[T]` float.
        mask: `[T]` bool.
        seq_ids: `[T]` int64, sample of each token (`sample_ids`).
        num_samples: S.

    Returns:
        `[S]`, dtype of values (differentiable w.r.t. values).
    """
    selected = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return torch.zeros(num_samples, dtype=values.dtype, device=values.device).index_add(0, seq_ids, selected)


def sequence_sum_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """Log of a sample's product of token ratios: `sum_{t in i, mask} log r_t` (0 for a sample with no mask token).

    exp() of it is the sequence-level importance ratio pi(y_i) / pi_behaviour(y_i) of the whole
    completion, the ratio of prime-rl's `ratio_type = "sequence"` (its loss.py:
    `seq_log_importance_ratio = log_importance_ratio[loss_mask].sum()`).

    Args/Returns: as `segment_sum`; `[S]` nats.
    """
    return segment_sum(log_ratio, mask, seq_ids, num_samples)


def sequence_mean_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """Log of a sample's geometric-mean token ratio: `(1/|y_i|) sum_{t in i, mask} log r_t`, |y_i| = mask tokens of i.

    exp() of it is GSPO's sequence ratio s_i = (pi(y_i) / pi_old(y_i))^(1/|y_i|) (Zheng et al. 2025,
    "Group Sequence Policy Optimization", arXiv:2507.18071, Eq. 7) and prime-rl's geo-mask ratio.
    A sample with no mask token gets 0 (ratio 1).

    Args/Returns: as `segment_sum`; `[S]` nats.
    """
    counts = segment_sum(torch.ones_like(log_ratio), mask, seq_ids, num_samples)
    return segment_sum(log_ratio, mask, seq_ids, num_samples) / counts.clamp(min=1.0)


def tis_weight(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Truncated importance-sampling weight `clip(pi_old / pi_rollout, low, high)`, per token, detached.

    Corrects for the sampler (pi_rollout, e.g. vLLM) not being the trainer's policy at the same
    weights (pi_old): the policy-gradient of each token is multiplied by this weight, truncated so
    its variance stays bounded. Source: Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly
    Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl (TIS, cap C = 2);
    the low bound follows slime's `tis_clip_low`.

    Args:
        old_logprobs: `[T]` float, log pi_old; nats.
        sampler_logprobs: `[T]` float, log pi_rollout; nats.
        low, high: bounds, 0 <= low < high.

    Returns:
        `[T]`, dtype of old_logprobs, in [low, high] (NaN where an input is NaN).
    """
    return torch.exp(old_logprobs.detach() - sampler_logprobs.to(old_logprobs.dtype)).clamp(low, high)
