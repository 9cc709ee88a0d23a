"""How per-token losses become the step's loss, split exactly across micro-batches and ranks.

With l the token losses, n_i the loss tokens of sample i, N of the step, G the step's samples with a
loss token and L the constant `max_tokens`: token_mean `sum l / N`, seq_mean_token_mean
`(1/G) sum_i (1/n_i) sum_t l`, seq_mean_token_sum_norm `sum l / (G L)`. A token's weight depends
only on its sample and `StepNorm`, so micro-batch losses sum to the step's. Sources: verl's
`agg_loss` modes; the last is Dr. GRPO (arXiv:2503.20783, Sec. 3.2), over G * L as in the paper and
TRL (verl's omits 1/G).
"""

from __future__ import annotations

import torch

from trainer.losses.estimators import sample_ids, segment_sum
from trainer.losses.spec import AGGREGATIONS, StepNorm

__all__ = ["aggregate_token_loss", "aggregation_weights", "loss_counts"]


def aggregation_weights(
    loss_mask: torch.Tensor, seq_ids: torch.Tensor, num_samples: int, norm: StepNorm, aggregation: str
) -> torch.Tensor:
    """`[T]` float64 weight of each token in `sum_t w_t l_t` (0 off `loss_mask`); ValueError: unknown aggregation."""
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
    """0-dim `sum_t w_t token_loss[t]`; tokens off `loss_mask` are dropped by `where`, so their inf/NaN never count."""
    weights = aggregation_weights(loss_mask, seq_ids, num_samples, norm, aggregation).to(token_loss.dtype)
    zero = torch.zeros((), dtype=token_loss.dtype, device=token_loss.device)
    return torch.where(loss_mask, token_loss * weights, zero).sum()


def loss_counts(loss_mask: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int]:
    """(loss tokens, samples with one) of `loss_mask` `[T]` split by `seq_lens` `[S]`; ValueError: no split of T."""
    seq_ids = sample_ids(seq_lens, int(loss_mask.shape[0]))
    per_sample = torch.zeros(int(seq_lens.numel()), dtype=torch.int64, device=seq_ids.device)
    per_sample = per_sample.index_add(0, seq_ids, loss_mask.long())
    return int(per_sample.sum()), int((per_sample > 0).sum())
