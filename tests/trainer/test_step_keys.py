"""The table of a trainer step's metrics keys (trainer/observability/step_keys.py): every key a step
reports has a row, and the gauges are the rows marked ``gauge``. Real steps are checked in
test_trainer (the step's own keys) and test_resume (the process's records in metrics.jsonl)."""

from __future__ import annotations

import math

import pytest

from trainer.observability.gauges import TRAINER_GAUGES
from trainer.observability.step_keys import STEP_KEYS, table_key, undocumented
from trainer.observability.step_stats import step_metrics


@pytest.mark.parametrize(
    "key, row",
    [
        ("loss", "loss"),
        ("reward/gsm8k", "reward/<name>"),
        ("lag_frac/>=3", "lag_frac/<bucket>"),
        ("time/forward_s", "time/<phase>_s"),
        ("time_share/forward", "time_share/<phase>"),
        ("reward/", None),  # a family needs a name
        ("time/forward", None),
        ("losses", None),
    ],
)
def test_table_key(key, row):
    assert table_key(key) == row


def test_every_option_s_key_has_a_row():
    """Totals as every loss option and reward term make them (kl_tau, teacher logprobs, TIS, lag
    buckets): step_metrics turns them into keys the table describes, and none is left over."""
    totals = {
        "loss": 0.5,
        "loss_tokens": 10.0,
        "num_tokens": 20.0,
        "num_samples": 2.0,
        "num_micro_batches": 1.0,
        "reward_sum": 1.0,
        "reward_sq_sum": 1.0,
        "reward_terms/gsm8k/sum": 1.0,
        "reward_terms/gsm8k/count": 2.0,
        "lag_tokens/0": 6.0,
        "lag_tokens/>=3": 4.0,
        "kl_penalty_sum": 0.1,
        "teacher_kl_sum": 0.2,
        "tis_clipped_tokens": 1.0,
        "decoder_tokens": 16.0,
        "non_finite_losses": 0.0,
        "non_finite_grad_max": 0.0,
    }
    metrics = step_metrics(totals, grad_norm=1.0, train_time_s=0.1, skipped=False)
    assert {"kl_penalty", "teacher_kl", "tis_clipfrac", "reward/gsm8k", "lag_frac/>=3", "decoder_tokens"} <= set(
        metrics
    )
    assert undocumented(metrics) == []
    assert undocumented({**metrics, "new_stat_sum": 1.0}) == ["new_stat_sum"]
    assert math.isclose(metrics["teacher_kl"], 0.02)


def test_the_gauges_are_the_rows_marked_gauge():
    assert set(TRAINER_GAUGES) == {key for key, row in STEP_KEYS.items() if row.gauge}
    assert all("<" not in key for key in TRAINER_GAUGES)
    assert TRAINER_GAUGES["loss"]._name == "rlbus_trainer_loss"
