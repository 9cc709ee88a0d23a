"""The keys of a trainer step's metrics, in one table: :data:`STEP_KEYS`.

A step's metrics (:meth:`trainer.trainer.Trainer.step` plus the process's own keys) are the
``metrics.jsonl`` record, the ``trainer.step`` message's ``metrics`` and, for the keys marked
``gauge``, the ``rlbus_trainer_<key>`` Prometheus gauges. ``docs/metrics.md`` is generated from this
table (``python -m busctl.metrics_reference``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STEP_KEYS", "StepKey", "table_key", "undocumented"]


@dataclass(frozen=True)
class StepKey:
    """One key: ``help`` (its meaning; the unit, if any, after the last comma) and whether the trainer
    exports it as the gauge ``rlbus_trainer_<key>`` (:data:`trainer.observability.gauges.TRAINER_GAUGES`)."""

    help: str
    gauge: bool = False


STEP_KEYS: dict[str, StepKey] = {
    "step": StepKey("Optimizer steps done (the policy version this step's update made); records only"),
    "loss": StepKey("The step's loss (NaN or inf on a skipped step)", gauge=True),
    "kl": StepKey("Mean k3 estimate of KL(infer || train) over the step's loss tokens, nats", gauge=True),
    "masked_frac": StepKey(
        "Fraction of the step's loss tokens given zero gradient by a mask (token, sequence, IcePop)", gauge=True
    ),
    "clipfrac": StepKey(
        "Fraction of the step's loss tokens whose gradient a clip removed (PPO/GSPO clip, dual clip)", gauge=True
    ),
    "entropy": StepKey("Mean entropy of the tempered policy over the step's loss tokens, nats", gauge=True),
    "importance_ratio_mean": StepKey(
        "Mean importance ratio pi_train / pi_rollout over the step's loss tokens", gauge=True
    ),
    "importance_ratio_min": StepKey("Smallest importance ratio pi_train / pi_rollout of the step", gauge=True),
    "importance_ratio_max": StepKey("Largest importance ratio pi_train / pi_rollout of the step", gauge=True),
    "kl_penalty": StepKey(
        "Mean KL-penalty estimator (trainer.loss.kl_estimator; only with kl_tau > 0) over the step's loss tokens, nats",
        gauge=True,
    ),
    "teacher_kl": StepKey(
        "Mean train_logprobs - teacher_logprobs (only with teacher logprobs) over the step's loss tokens, nats",
        gauge=True,
    ),
    "tis_clipfrac": StepKey("Fraction of the step's loss tokens whose TIS weight was clipped (only with TIS)"),
    "grad_norm": StepKey("Gradient norm before clipping (NaN or inf on a skipped step)", gauge=True),
    "lr": StepKey("Learning rate of the step's update (trainer.optim's schedule)", gauge=True),
    "skipped": StepKey("1 when the non-finite guard skipped the optimizer step (weights unchanged), else 0"),
    "num_tokens": StepKey("Tokens of the step's packed rows, tokens"),
    "num_loss_tokens": StepKey("Loss tokens of the step, tokens", gauge=True),
    "decoder_tokens": StepKey("Tokens the decoder ran: num_tokens less the shared prompt prefixes, tokens"),
    "num_samples": StepKey("Samples in the step, samples"),
    "num_micro_batches": StepKey("Micro-batches in the step"),
    "reward_mean": StepKey("Mean reward of the step's samples", gauge=True),
    "reward_std": StepKey("Population standard deviation of the step's sample rewards"),
    "reward/<name>": StepKey(
        "Mean score of reward function <name> over the step's samples that carry it "
        "(gauge rlbus_trainer_reward_term_mean{reward})"
    ),
    "onpolicy_tokens": StepKey("Loss tokens sampled by exactly the weights being trained, tokens"),
    "onpolicy_lp_diff_max": StepKey("Largest |train - sampler logprob| over the on-policy loss tokens, nats"),
    "lag_frac/<bucket>": StepKey(
        "Fraction of the step's loss tokens sampled at off-policy lag <bucket> (0, 1, 2, >=3 steps; "
        "gauge rlbus_trainer_lag_token_frac{lag})"
    ),
    "policy_lag_mean": StepKey("Mean off-policy lag of the step's samples (their oldest token), steps", gauge=True),
    "policy_lag_max": StepKey("Largest off-policy lag of the step's samples, steps"),
    "train_time_s": StepKey("Wall time of Trainer.step on rank 0, seconds"),
    "time/<phase>_s": StepKey(
        "The step's wall time in <phase>: wait_data, forward, backward, optimizer, weight_send, bookkeeping "
        "(trainer.observability.step_timing; counter rlbus_trainer_phase_seconds_total{phase}), seconds"
    ),
    "step_time_s": StepKey(
        "Wall time of the whole step, the wait for data included (histogram rlbus_trainer_step_seconds), seconds"
    ),
    "tokens_per_s": StepKey("Trained tokens per second of step_time_s", gauge=True),
    "weight_sync_s": StepKey("Time the trainer thread spent publishing the step's weights, seconds"),
    "idle_thread_micro_batches": StepKey("Micro-batches since the last step run at trainer.idle_threads threads"),
    "time_share/<phase>": StepKey("Share of the last 10 steps' wall time in <phase>; trainer.step messages only"),
}
"""Every key of a step's metrics -> :class:`StepKey`; ``<name>`` marks a family of keys."""

_FAMILIES = [(k.split("<")[0], k.rpartition(">")[2]) for k in STEP_KEYS if "<" in k]


def table_key(key: str) -> str | None:
    """The row of :data:`STEP_KEYS` that ``key`` is (``reward/gsm8k`` -> ``reward/<name>``), or None."""
    if key in STEP_KEYS:
        return key
    for (head, tail), row in zip(_FAMILIES, (k for k in STEP_KEYS if "<" in k)):
        if key.startswith(head) and key.endswith(tail) and len(key) > len(head) + len(tail):
            return row
    return None


def undocumented(metrics: dict) -> list[str]:
    """The keys of ``metrics`` that no row of :data:`STEP_KEYS` describes, sorted."""
    return sorted(k for k in metrics if table_key(k) is None)
