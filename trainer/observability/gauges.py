"""The trainer's per-step Prometheus series, set from each step's metrics (:func:`export_step_metrics`).

Names and help texts come from :data:`trainer.observability.step_keys.STEP_KEYS`. A gauge whose key
is missing from a step's metrics keeps its last value (an option that is off exports no false 0).
"""

from __future__ import annotations

from prometheus_client import Gauge, Histogram

from telemetry.metrics import POLICY_VERSION
from trainer.observability.step_keys import STEP_KEYS

__all__ = ["LAG_TOKEN_FRAC", "REWARD_TERMS", "STEP_SECONDS", "TRAINER_GAUGES", "export_step_metrics"]

STEP_SECONDS = Histogram("rlbus_trainer_step_seconds", "Wall time per optimizer step incl. waiting for data, seconds")
TRAINER_GAUGES = {key: Gauge(f"rlbus_trainer_{key}", k.help) for key, k in STEP_KEYS.items() if k.gauge}
"""``rlbus_trainer_<key>`` for every step key marked ``gauge`` (:data:`trainer.observability.step_keys.STEP_KEYS`)."""
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
