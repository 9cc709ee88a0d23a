"""bench.vs_trl_stats and bench.vs_trl's metrics.jsonl parsing: the definitions of the benchmark's numbers."""

from __future__ import annotations

import math

import pytest

from bench.vs_trl import metrics_events
from bench.vs_trl_stats import floor_samples_per_s, markdown_table, step_flops, summarize_arm


def _events() -> list[dict]:
    # Launch at t=100; step s ends at 110 + s for s = 1..9, step 10 at 122 (a slow step in the window);
    # evals: 0.40 at step 0, 0.50 at step 5 (t=115.5), 0.56 at step 10 (t=122.5).
    ev = [
        {"t": 110.0 + s, "kind": "step", "step": s, "num_tokens": 4800 + s, "completion_tokens": 1200}
        for s in range(1, 10)
    ]
    ev.append({"t": 122.0, "kind": "step", "step": 10, "num_tokens": 4810, "completion_tokens": 1200})
    ev += [
        {"t": 105.0, "kind": "eval", "step": 0, "reward_mean": 0.40},
        {"t": 115.5, "kind": "eval", "step": 5, "reward_mean": 0.50},
        {"t": 122.5, "kind": "eval", "step": 10, "reward_mean": 0.56},
    ]
    return ev[::-1]  # any order


def test_summarize_arm_definitions() -> None:
    s = summarize_arm(_events(), 100.0, 128, steady_skip=0.1)
    # first 10% of 10 steps = step 1 left out as the window's start: steps 1..10 span t 111..122
    assert s["steady_from_step"] == 1
    assert s["samples_per_s"] == pytest.approx(128 * 9 / 11)
    assert s["first_step_s"] == pytest.approx(11.0)
    assert s["wall_s"] == pytest.approx(22.0)
    assert s["eval_target"] == pytest.approx(0.55)
    assert s["eval_target_s"] == pytest.approx(22.5)  # step 5's 0.50 is below 0.55; step 10's 0.56 is not
    assert s["eval_final"] == pytest.approx(0.56)
    assert s["mean_tokens_per_step"] == pytest.approx(4805.5)
    s3 = summarize_arm(_events(), 100.0, 128, steady_skip=0.3)
    assert s3["steady_from_step"] == 3 and s3["samples_per_s"] == pytest.approx(128 * 7 / 9)


def test_summarize_arm_target_never_reached_and_errors() -> None:
    s = summarize_arm(_events(), 100.0, 128, eval_delta=0.2)
    assert s["eval_target_s"] is None
    with pytest.raises(ValueError, match="no step events"):
        summarize_arm([e for e in _events() if e["kind"] == "eval"], 100.0, 128)
    with pytest.raises(ValueError, match="at least two steps"):
        summarize_arm([{"t": 1.0, "kind": "step", "step": 1}], 0.0, 128)
    with pytest.raises(ValueError, match="batch"):
        summarize_arm(_events(), 100.0, 0)


def test_floor_arithmetic() -> None:
    # issue 14: N = 1.12M, ~4.9k tokens trained and ~1.2k generated per step at 146 GFLOP/s
    flops = step_flops(1_116_288, 4900, 1200)
    assert flops == 6 * 1_116_288 * 4900 + 2 * 1_116_288 * 1200
    assert flops / 1e9 == pytest.approx(35.5, abs=0.1)
    rate = floor_samples_per_s(128, flops, 146.0)
    assert rate == pytest.approx(128 / (flops / 146e9))
    assert math.isclose(rate, 526.4, rel_tol=1e-3)
    with pytest.raises(ValueError, match="num_params"):
        step_flops(0, 1, 1)
    with pytest.raises(ValueError, match="positive"):
        floor_samples_per_s(128, flops, 0.0)


def test_metrics_events_reads_rlbus_records() -> None:
    # a record of an rlbus run's metrics.jsonl (the trainer's steps) and one of its eval.jsonl (the packer's)
    train = {"step": 3, "loss": -0.1, "num_tokens": 4713.0, "num_loss_tokens": 1193.0, "reward_mean": 0.43}
    evl = {"step": 0, "eval/reverse_text/num_samples": 128, "eval/reverse_text/reward_mean": 0.40}
    key = "eval/reverse_text/reward_mean"
    assert metrics_events(train, 5.0, key) == [
        {"t": 5.0, "kind": "step", "step": 3, "num_tokens": 4713.0, "completion_tokens": 1193.0}
    ]
    assert metrics_events(evl, 6.0, key) == [{"t": 6.0, "kind": "eval", "step": 0, "reward_mean": 0.40}]
    assert metrics_events(evl, 6.0, "eval/gsm8k/reward_mean") == []


def test_markdown_table_ratios() -> None:
    trl = summarize_arm(_events(), 100.0, 128)
    fast = summarize_arm([{**e, "t": 100 + (e["t"] - 100) / 2} for e in _events()], 100.0, 128)
    table = markdown_table(trl, fast, {"gflops": 146.0, "flops_per_step": 35.5e9, "samples_per_s": 526.4})
    row = next(line for line in table.splitlines() if line.startswith("| steady-state samples/s"))
    assert row.endswith("| 2.00 |")
    assert "rlbus/floor: 0.40 |" in table  # 209.5 / 526.4
