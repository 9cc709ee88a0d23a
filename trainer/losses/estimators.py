"""Pure formulas of the policy losses: KL estimators, sequence ratios, the TIS weight and the token ->
sample bookkeeping. Tensors are `[T]` (tokens) or `[S]` (samples), log-probabilities in nats; nothing
reads outside a mask's tokens, so their inf/NaN never leak.
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
    """k1 estimator of KL(q || p), x ~ q: `-log r`, r = p(x) / q(x) (Schulman, http://joschu.net/blog/kl-approx.html)."""
    return -log_r


def kl_k2(log_r: torch.Tensor) -> torch.Tensor:
    """k2 estimator: `(log r)^2 / 2`; biased, >= 0, low variance (Schulman 2020)."""
    return 0.5 * log_r.square()


def kl_k3(log_r: torch.Tensor) -> torch.Tensor:
    """k3 estimator: `(r - 1) - log r`, via expm1; unbiased, >= 0 (Schulman 2020; verl's "low_var_kl")."""
    return torch.expm1(log_r) - log_r


_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(train_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """`[T]` verl's `kl_penalty` k1/k2/k3 of log r = ref - train logprobs (k3 clamped to +-LOG_RATIO_BOUND),
    estimating KL(pi_train || pi_ref), differentiable w.r.t. `train_logprobs`; ValueError for another estimator.
    """
    if estimator not in _ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {', '.join(_ESTIMATORS)}; got {estimator!r}")
    log_r = ref_logprobs.detach().to(train_logprobs.dtype) - train_logprobs
    if estimator == "k3":
        log_r = log_r.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return _ESTIMATORS[estimator](log_r)


def mismatch_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """`[T]` k3 estimate of KL(pi_rollout || pi_train) from `log_ratio` = train - sampler logprobs."""
    return kl_k3(log_ratio)


def sample_ids(seq_lens: torch.Tensor, num_tokens: int, *, checked: bool = False) -> torch.Tensor:
    """`[T]` int64 sample of each token ([2, 3] -> [0, 0, 1, 1, 1]); ValueError for bad `seq_lens` unless `checked`."""
    lens = seq_lens.long() if checked else validated_seq_lens(seq_lens)
    if not checked and int(lens.sum()) != num_tokens:
        raise ValueError(f"seq_lens must sum to the packed length {num_tokens}, got sum {int(lens.sum())}")
    # output_size: the result's length is known, so no device read to size it
    return torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens, output_size=num_tokens)


def segment_sum(values: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int) -> torch.Tensor:
    """`[S]` per-sample sum of `values` `[T]` over the tokens where `mask` (others zeroed first)."""
    selected = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return torch.zeros(num_samples, dtype=values.dtype, device=values.device).index_add(0, seq_ids, selected)


def sequence_sum_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """`[S]` log of each sample's product of masked token ratios (prime-rl's `ratio_type = "sequence"`)."""
    return segment_sum(log_ratio, mask, seq_ids, num_samples)


def sequence_mean_log_ratio(
    log_ratio: torch.Tensor, mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int
) -> torch.Tensor:
    """`[S]` log geometric-mean masked token ratio per sample: GSPO's s_i (arXiv:2507.18071, Eq. 7)."""
    counts = segment_sum(torch.ones_like(log_ratio), mask, seq_ids, num_samples)
    return segment_sum(log_ratio, mask, seq_ids, num_samples) / counts.clamp(min=1.0)


def tis_weight(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """`[T]` truncated importance-sampling weight `clip(pi_old / pi_rollout, low, high)`, detached (Yao et al.
    2025, https://fengyao.notion.site/off-policy-rl; `low` as slime's `tis_clip_low`).
    """
    return torch.exp(old_logprobs.detach() - sampler_logprobs.to(old_logprobs.dtype)).clamp(low, high)
