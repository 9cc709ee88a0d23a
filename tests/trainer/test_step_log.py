"""The trainer's per-step log line (trainer.observability.step_log.step_line) from hand-written metrics."""

from __future__ import annotations

import math

import pytest

from trainer.observability.step_log import step_line


def test_the_line_names_step_loss_reward_kl_time_and_lag():
    metrics = {
        "loss": 0.012345,
        "reward_mean": 0.5,
        "reward_std": 0.25,
        "kl": 0.00123,
        "entropy": 0.84,
        "grad_norm": 0.333,
        "step_time_s": 3.214,
        "time/wait_data_s": 0.1,
        "policy_lag_mean": 0.4,
        "policy_lag_max": 1.0,
        "tokens_per_s": 1234.4,
    }
    assert step_line(12, 200, metrics) == (
        "step 12/200 loss 0.01235 reward 0.5 (std 0.25) kl 0.00123 entropy 0.84 "
        "grad_norm 0.333 step 3.21 s (wait 0.10 s) lag 0.40 (max 1) 1234 tok/s"
    )


def test_missing_keys_are_left_out_and_a_skipped_step_says_so():
    line = step_line(1, 1, {"skipped": 1.0, "loss": math.nan, "step_time_s": 0.5})
    assert line == "step 1/1 SKIPPED (non-finite loss or gradient: no update) loss nan step 0.50 s"


@pytest.mark.parametrize("step", [0, 5])
def test_a_step_outside_the_run_is_refused(step):
    with pytest.raises(ValueError, match=rf"step {step} is outside 1..trainer.max_steps \(4\)"):
        step_line(step, 4, {})
