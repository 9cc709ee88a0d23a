"""``busctl report``'s loss tokens by lag: the trainer's per-step ``lag_frac/<bucket>`` weighted by
each step's loss tokens (busctl.report.lag_token_shares), from a run directory's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from busctl.report import lag_token_shares, write_report
from busctl.run_data import load_run


def test_report_weights_lag_fractions_by_loss_tokens(tmp_path: Path) -> None:
    records = [
        {
            "step": 1,
            "reward_mean": 0.1,
            "num_loss_tokens": 100.0,
            "lag_frac/0": 1.0,
            "lag_frac/1": 0.0,
            "lag_frac/2": 0.0,
            "lag_frac/>=3": 0.0,
        },
        {
            "step": 2,
            "reward_mean": 0.2,
            "num_loss_tokens": 300.0,
            "lag_frac/0": 0.5,
            "lag_frac/1": 0.25,
            "lag_frac/2": 0.0,
            "lag_frac/>=3": 0.25,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    shares = lag_token_shares(load_run(tmp_path))
    # lag 0: 100 + 150 of 400 tokens, lag 1: 75, lag 2: 0, >= 3: 75
    assert list(shares) == ["0", "1", "2", ">=3"]
    assert shares == pytest.approx({"0": 250 / 400, "1": 75 / 400, "2": 0.0, ">=3": 75 / 400})
    _, text = write_report(tmp_path)
    assert "loss tokens by lag (steps): 0 62.5%, 1 18.8%, 2 0.0%, >=3 18.8%" in text


def test_runs_without_lag_fractions_have_no_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.1, "num_loss_tokens": 10.0}) + "\n")
    assert lag_token_shares(load_run(tmp_path)) == {}
    assert "loss tokens by lag" not in write_report(tmp_path)[1]
