"""The policy losses (AIPO, PPO-clip, importance sampling, GSPO) with IcePop, TIS, a KL penalty,
on-policy distillation and three aggregations, normalized step-wide; the public names.
"""

from trainer.losses.aggregation import aggregate_token_loss, aggregation_weights, loss_counts
from trainer.losses.estimators import (
    LOG_RATIO_BOUND,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    mismatch_kl,
    sample_ids,
    segment_sum,
    sequence_mean_log_ratio,
    sequence_sum_log_ratio,
    tis_weight,
)
from trainer.losses.masks import geo_mean_mask, icepop_mask, keep_mask, ratio_in_bounds, sequence_extreme_mask
from trainer.losses.objectives import (
    aipo_token_loss,
    clipped_surrogate,
    gspo_token_loss,
    importance_sampling_token_loss,
    ppo_clip_token_loss,
)
from trainer.losses.checks import check_loss_inputs
from trainer.losses.policy import policy_loss, policy_loss_terms, stats_to_floats
from trainer.losses.spec import (
    AGGREGATIONS,
    KL_ESTIMATORS,
    KL_REFERENCES,
    LOSS_TYPES,
    RATIO_TYPES,
    LossBatch,
    LossSpec,
    StepNorm,
)

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "KL_REFERENCES",
    "LOG_RATIO_BOUND",
    "LOSS_TYPES",
    "RATIO_TYPES",
    "LossBatch",
    "LossSpec",
    "StepNorm",
    "aggregate_token_loss",
    "aggregation_weights",
    "aipo_token_loss",
    "check_loss_inputs",
    "clipped_surrogate",
    "geo_mean_mask",
    "gspo_token_loss",
    "icepop_mask",
    "importance_sampling_token_loss",
    "keep_mask",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "loss_counts",
    "mismatch_kl",
    "policy_loss",
    "policy_loss_terms",
    "ppo_clip_token_loss",
    "ratio_in_bounds",
    "sample_ids",
    "segment_sum",
    "sequence_extreme_mask",
    "sequence_mean_log_ratio",
    "sequence_sum_log_ratio",
    "stats_to_floats",
    "tis_weight",
]
