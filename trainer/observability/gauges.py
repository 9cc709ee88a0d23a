"""The trainer's per-step Prometheus series: step time, the last step's loss statistics, rewards.

One place for the gauges :mod:`trainer.proc` sets after every optimizer step from the step's
metrics dict (:meth:`trainer.trainer.Trainer.step` plus the process's own keys), so the metric
names and help texts live apart from the step loop. Invariant: a gauge whose key is missing from a
step's metrics keeps its last value (options that are off never export a misleading 0).
"""

from __future__ import annotations

from prometheus_client import Gauge, Histogram

from telemetry.metrics import POLICY_VERSION

__all__ = ["LAG_TOKEN_FRAC", "REWARD_TERMS", "STEP_SECONDS", "TRAINER_GAUGES", "export_step_metrics"]

STEP_SECONDS = Histogram("rlbus_trainer_step_seconds", "Wall time per optimizer step incl. waiting for data, seconds")
TRAINER_GAUGES = {
    key: Gauge(f"rlbus_trainer_{key}", doc)
    for key, doc in {
        "reward_mean": "Mean reward of the last step's samples",
        "loss": "Loss of the last step",
        "kl": "Mean k3 KL(infer || train) estimate of the last step, nats",
        "masked_frac": "Fraction of the last step's loss tokens given zero gradient by a mask (token, sequence, IcePop)",
        "clipfrac": "Fraction of the last step's loss tokens whose gradient a clip removed (PPO/GSPO clip, dual clip)",
        "entropy": "Mean entropy of the tempered policy over the last step's loss tokens, nats",
        "importance_ratio_mean": "Mean importance ratio pi_train / pi_rollout over the last step's loss tokens",
        "importance_ratio_min": "Smallest importance ratio pi_train / pi_rollout of the last step",
        "importance_ratio_max": "Largest importance ratio pi_train / pi_rollout of the last step",
        "num_loss_tokens": "Loss tokens of the last step, tokens",
        "kl_penalty": "Mean KL-penalty estimator (trainer.loss.kl_estimator) of the last step, nats (when kl_tau > 0)",
        "teacher_kl": "Mean train_logprobs - teacher_logprobs over the last step's loss tokens, nats (with teacher logprobs)",
        "grad_norm": "Gradient norm before clipping",
        "lr": "Learning rate of the last step's update (trainer.optim's schedule)",
        "policy_lag_mean": "Mean off-policy lag of the last step's samples, steps",
        "tokens_per_s": "Trained tokens per second of wall time",
    }.items()
}
REWARD_TERMS = Gauge(
    "rlbus_trainer_reward_term_mean", "Mean score of one reward function over the last step's samples", ["reward"]
)
LAG_TOKEN_FRAC = Gauge(
    "rlbus_trainer_lag_token_frac",
    "Fraction of the last step's loss tokens sampled at each off-policy lag (steps; '>=3' the rest)",
    ["lag"],
)


def export_step_metrics(version: int, metrics: dict[str, float]) -> None:
    """Set the policy version (steps taken), observe ``step_time_s`` (seconds) and set every
    gauge of :data:`TRAINER_GAUGES`, ``reward/<name>`` and ``lag_frac/<bucket>`` found in ``metrics``.

    Raises:
        KeyError: ``metrics`` has no ``step_time_s``.
    """
    POLICY_VERSION.set(version)
    STEP_SECONDS.observe(metrics["step_time_s"])
    for key, gauge in TRAINER_GAUGES.items():
        if key in metrics:
            gauge.set(metrics[key])
    for key, value in metrics.items():
        if key.startswith("reward/"):
            REWARD_TERMS.labels(reward=key[len("reward/") :]).set(value)
        elif key.startswith("lag_frac/"):
            LAG_TOKEN_FRAC.labels(lag=key[len("lag_frac/") :]).set(value)
