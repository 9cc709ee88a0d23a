"""How per-token losses become the step's loss, split exactly across micro-batches and ranks.

With l_{i,t} the loss of token t of sample i, n_i the loss tokens of sample i (masked ones
included), N the loss tokens of the step, G the samples of the step with n_i >= 1, and L the
constant `max_tokens`, the step loss is:

    token_mean               sum_{i,t} l_{i,t} / N
    seq_mean_token_mean      (1/G) sum_i (1/n_i) sum_t l_{i,t}
    seq_mean_token_sum_norm  (1/G) sum_i sum_t l_{i,t} / L          (Dr. GRPO)

Each is a weighted sum `sum_t w_t l_t` with a weight that depends only on the token's own sample
and on step-wide constants (N, G, L from `StepNorm`), so the loss of a micro-batch with these
weights is its exact share of the step loss, and summing micro-batch losses (gradients summed,
not averaged, over ranks) gives the step loss whatever the split, provided no sample is split.

Sources: verl `agg_loss` (verl/trainer/ppo/core_algos.py) modes "token-mean",
"seq-mean-token-mean", "seq-mean-token-sum-norm". For the last, Dr. GRPO (Liu et al. 2025,
"Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783, Sec. 3.2 and its
listing: masked_mean's per-sample length divisor replaced by the constant MAX_TOKENS, then the
mean over the batch) divides by G * L, as TRL's `loss_type="dr_grpo"` does
(`sum / (batch_size * max_completion_length)`); verl's agg_loss divides the batch sum by L only
(no 1/G). We follow the paper: at a fixed batch size the two differ by a constant factor only.
Samples with no loss token contribute nothing and are not counted in G.
"""

from __future__ import annotations

import torch

from trainer.losses.estimators import sample_ids, segment_sum
from trainer.losses.spec import AGGREGATIONS, StepNorm

__all__ = ["aggregate_token_loss", "aggregation_weights", "loss_counts"]


def aggregation_weights(
    loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int, norm: StepNorm, aggregation: str
) -> torch.Tensor:
    """Weight w_t of each token in the step loss `sum_t w_t l_t` (see the module docstring).

        token_mean               w_t = 1 / N
        seq_mean_token_mean      w_t = 1 / (n_i * G)
        seq_mean_token_sum_norm  w_t = 1 / (L * G)
    and w_t = 0 off loss_mask. A zero normalizer (a step with no loss token) gives all-zero weights.

    Args:
        loss_mask: `[T]` bool.
        seq_ids: `[T]` int64 sample of each token.
        num_samples: S of this micro-batch.
        norm: step-wide N (loss_tokens), G (num_samples), L (max_tokens).
        aggregation: one of AGGREGATIONS.

    Returns:
        `[T]` float64 weights.

    Raises:
        ValueError: unknown aggregation.
    """
    mask = loss_mask.double()
    if aggregation == "token_mean":
        return mask / max(norm.loss_tokens, 1)
    if aggregation == "seq_mean_token_mean":
        n_i = segment_sum(mask, loss_mask, seq_ids, num_samples)[seq_ids]
        return mask / (n_i.clamp(min=1.0) * max(norm.num_samples, 1))
    if aggregation == "seq_mean_token_sum_norm":
        return mask / (norm.max_tokens * max(norm.num_samples, 1))
    raise ValueError(f"aggregation must be one of {', '.join(AGGREGATIONS)}; got {aggregation!r}")


def aggregate_token_loss(
    token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_ids: torch.Tensor,
    num_samples: int,
    norm: StepNorm,
    aggregation: str,
) -> torch.Tensor:
    """This micro-batch's share of the step loss: `sum_t w_t * token_loss[t]` (weights of `aggregation_weights`).

    Tokens off loss_mask are dropped with `where`, so an inf/NaN there never reaches the sum.

    Args:
        token_loss: `[T]` float, per-token loss (grad flows through it).
        loss_mask, seq_ids, num_samples, norm, aggregation: as `aggregation_weights`.

    Returns:
        0-dim tensor, dtype of token_loss.
    """
    weights = aggregation_weights(loss_mask, seq_ids, num_samples, norm, aggregation).to(token_loss.dtype)
    zero = torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)
    return torch.where(loss_mask, token_loss * weights, zero).sum()


def loss_counts(loss_mask: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int]:
    """This micro-batch's contribution to `StepNorm`: (loss tokens, samples with >= 1 loss token).

    Sum these over every micro-batch (and rank) of a step to build its `StepNorm`.

    Args:
        loss_mask: `[T]` bool.
        seq_lens: `[S]` int, sample lengths >= 1 summing to T.

    Returns:
        (loss_tokens, num_samples) as python ints.

    Raises:
        ValueError: seq_lens do not split T.
    """
    seq_ids = sample_ids(seq_lens, int(loss_mask.shape[0]))
    per_sample = torch.zeros(int(seq_lens.numel()), dtype=torch.int64, device=seq_ids.device)
    per_sample = per_sample.index_add(0, seq_ids, loss_mask.long())
    return int(per_sample.sum()), int((per_sample > 0).sum())
