"""``busctl report`` on run directories written by the test: every plot is a real PNG with
content, the summary's numbers are the ones computed here from the same files, missing series
are skipped with a note, and unusable run directories exit 2 with a message naming the file."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from busctl.cli import main as busctl
from busctl.run_data import load_run, moving_average, smoothing_window
from busctl.throughput import run_throughput_text

STEPS = 24
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def step_record(s: int) -> dict:
    """Training record of step ``s`` (1-based), deterministic and not monotone."""
    return {
        "step": s,
        "loss": 0.1,
        "kl": 0.01 * (s % 5),
        "entropy": 2.0 - 0.02 * s,
        "reward_mean": 0.3 + 0.02 * s + 0.05 * math.sin(s),
        "reward_std": 0.1,
        "reward/lcs": 0.25 + 0.01 * s,
        "policy_lag_mean": (s % 3) / 2,
        "policy_lag_max": float(s % 3),
        "num_tokens": 1000.0 + 10 * s,
        "step_time_s": 0.5 + 0.01 * s,
        "tokens_per_s": (1000.0 + 10 * s) / (0.5 + 0.01 * s),
    }


def stages_record(step: int, t: float) -> dict:
    comp = {
        "producer-0": {
            "role": "producer",
            "throughput": {"tokens_per_s": 100.0 + step, "samples_per_s": 3.0},
            "busy": 0.9,
        },
        "producer-1": {"role": "producer", "throughput": {"tokens_per_s": 50.0, "samples_per_s": 1.0}, "busy": 0.7},
        "rewards-0": {"role": "rewards", "throughput": {"tokens_per_s": 140.0, "samples_per_s": 4.0}, "busy": 0.1},
        "packer": {"role": "packer", "throughput": {"tokens_per_s": None, "samples_per_s": None}, "busy": None},
        "hub": {"role": "hub", "throughput": {"tokens_per_s": None, "samples_per_s": None}, "busy": None},
    }
    return {"time": t, "step": step, "components": comp}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    evals = [
        {
            "step": 0,
            "eval/reverse_text/reward_mean": 0.2,
            "eval/reverse_text/num_samples": 16,
            "eval/countdown/reward_mean": 0.05,
        },
        {"step": 12, "eval/reverse_text/reward_mean": 0.4, "eval/countdown/reward_mean": 0.1},
        {"step": STEPS, "eval/reverse_text/reward_mean": 0.55, "eval/countdown/reward_mean": 0.15},
    ]
    write_jsonl(run / "eval.jsonl", evals)  # the packer's
    write_jsonl(run / "metrics.jsonl", [step_record(s) for s in range(1, STEPS + 1)])  # the trainer's
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 25, "loss": 0.1, "kl"')  # a trainer killed mid-line
    write_jsonl(run / "stages.jsonl", [stages_record(s, 1000.0 + s) for s in range(0, STEPS + 1, 2)])
    write_jsonl(
        run / "samples.jsonl",
        [{"step": s, "sample": j, "reward": 0.5, "advantage": 0.0} for s in (0, 10, 20) for j in range(4)],
    )
    (run / "accounting.json").write_text(
        json.dumps(
            {
                "issued": 110,
                "outcomes": {"trained": 96, "dropped_stale": 9, "filtered": 5, "failed": 0},
                "unresolved": [],
            }
        )
    )
    reg = CollectorRegistry()
    groups = Counter("rlbus_packer_groups_total", "groups by outcome", ["outcome"], registry=reg)
    groups.labels("accepted").inc(105)
    groups.labels("stale").inc(9)
    groups.labels("filtered: equal_rewards").inc(5)
    (run / "metrics_final").mkdir()
    (run / "metrics_final" / "packer.prom").write_bytes(generate_latest(reg))
    return run


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def g4(x: float) -> str:
    return f"{x:.4g}"


def test_report_writes_every_plot_and_the_summary_numbers(run_dir: Path, capsys) -> None:
    assert busctl(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    report = run_dir / "report"
    for name in ("reward", "eval_reward", "kl", "entropy", "lag", "throughput"):
        path = report / f"{name}.png"
        width, height = png_size(path)
        assert width >= 600 and height >= 300 and path.stat().st_size > 10_000, (
            name,
            width,
            height,
            path.stat().st_size,
        )
        pixels = matplotlib.image.imread(path)
        assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50, f"{name}.png looks blank"
    summary = (report / "summary.txt").read_text()
    assert summary in out  # printed as well

    # expected numbers, computed here from the records written above
    recs = [step_record(s) for s in range(1, STEPS + 1)]
    rewards = [r["reward_mean"] for r in recs]
    w = STEPS // 4  # clamp(24 // 4, 1, 10) = 6
    assert smoothing_window(STEPS) == w
    windows = [float(np.mean(rewards[i - w + 1 : i + 1])) for i in range(w - 1, STEPS)]
    best = int(np.argmax(windows))
    assert (
        f"steps: {STEPS} (records step 1..{STEPS}), training time {g4(sum(r['step_time_s'] for r in recs))} s"
        in summary
    )
    assert (
        f"reward_mean ({w}-step mean): first {g4(np.mean(rewards[:w]))}, last {g4(np.mean(rewards[-w:]))}, "
        f"best {g4(windows[best])} (window ending at step {best + w})"
    ) in summary
    assert f"reward terms (last window): lcs {g4(np.mean([r['reward/lcs'] for r in recs][-w:]))}" in summary
    assert "eval countdown reward_mean: first 0.05 (round 0), last 0.15 (round 24)" in summary
    assert "eval reverse_text reward_mean: first 0.2 (round 0), last 0.55 (round 24)" in summary
    assert (
        f"kl mean {g4(np.mean([r['kl'] for r in recs]))}, entropy mean {g4(np.mean([r['entropy'] for r in recs]))}"
        in summary
    )
    assert f"policy lag: mean {g4(np.mean([r['policy_lag_mean'] for r in recs]))}, max 2 steps" in summary
    tokens_per_s = sum(r["num_tokens"] for r in recs) / sum(r["step_time_s"] for r in recs)
    line = f"trainer throughput over {STEPS} steps: {tokens_per_s:,.0f} all tokens/s (per second of step time)"
    assert line in summary.splitlines()
    assert run_throughput_text(run_dir) == line  # busctl status prints the same line
    producer = np.mean([100.0 + s + 50.0 for s in range(0, STEPS + 1, 2)])  # two replicas summed, averaged over polls
    assert f"stage producer: {g4(producer)} completion tokens/s of wall time, busy 80%" in summary
    assert "stage rewards: 140 completion tokens/s of wall time, busy 10%" in summary
    assert "stage packer" not in summary and "stage hub" not in summary  # nothing recorded for them
    assert "packer groups by outcome: accepted 105, filtered: equal_rewards 5, stale 9" in summary
    assert "prompts: issued 110; outcomes trained 96, dropped_stale 9, filtered 5, failed 0; unresolved 0" in summary
    assert "samples.jsonl: 12 examples from 3 steps" in summary
    assert "note: metrics.jsonl: skipped 1 line(s)" in summary


def test_load_run_separates_training_and_eval_records(run_dir: Path) -> None:
    run = load_run(run_dir)
    assert [r["step"] for r in run.steps] == list(range(1, STEPS + 1))
    assert [r for r, _ in run.evals["reverse_text"]] == [0, 12, STEPS]
    assert run.evals["reverse_text"][0][1] == {"reward_mean": 0.2, "num_samples": 16}
    assert run.skipped_lines == {"metrics.jsonl": 1}


def test_missing_series_are_skipped_with_a_note(tmp_path: Path, capsys) -> None:
    run = tmp_path / "old"
    run.mkdir()
    recs = [{"step": 0, "eval_reward_mean": 0.4, "eval_num_samples": 16.0}]  # an old run: no per-task eval, no entropy
    recs += [{k: v for k, v in step_record(s).items() if k not in ("entropy", "reward/lcs")} for s in (1, 2, 3)]
    write_jsonl(run / "metrics.jsonl", recs)
    out_dir = tmp_path / "elsewhere"
    assert busctl(["report", str(run), "--out", str(out_dir)]) == 0
    assert sorted(p.name for p in out_dir.glob("*.png")) == [
        "eval_reward.png",
        "kl.png",
        "lag.png",
        "reward.png",
        "throughput.png",
    ]
    summary = (out_dir / "summary.txt").read_text()
    assert "note: entropy.png: not plotted, no entropy in metrics.jsonl" in summary
    assert "no stages.jsonl" in summary
    assert "eval eval reward_mean: first 0.4 (round 0), last 0.4 (round 0)" in summary
    rewards = [step_record(s)["reward_mean"] for s in (1, 2, 3)]  # window 1 for 3 steps
    assert f"first {g4(rewards[0])}, last {g4(rewards[2])}, best {g4(max(rewards))}" in summary
    assert not (run / "report").exists()


@pytest.mark.parametrize("case", ["no_dir", "no_file", "empty", "eval_only"])
def test_unusable_run_dirs_exit_2_naming_the_file(tmp_path: Path, capsys, case: str) -> None:
    run = tmp_path / "run"
    if case != "no_dir":
        run.mkdir()
    if case == "empty":
        (run / "metrics.jsonl").write_text("\n")
    if case == "eval_only":  # a busctl eval run: eval records, no training record
        write_jsonl(run / "eval.jsonl", [{"step": 0, "eval/reverse_text/reward_mean": 0.1}])
    assert busctl(["report", str(run)]) == 2
    err = " ".join(capsys.readouterr().err.split())  # errors go to stderr; rich may wrap
    named = str(run) if case == "no_dir" else str(run / "metrics.jsonl")
    assert named in err, err
    assert not (run / "report").exists()


def test_moving_average_is_trailing_and_skips_nan() -> None:
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_average([1.0, math.nan, 5.0], 2) == [1.0, 1.0, 5.0]
    with pytest.raises(ValueError):
        moving_average([1.0], 0)


def test_stages_accept_status_rows_as_a_list(tmp_path: Path) -> None:
    from busctl.run_data import stage_series

    rows = [{"name": n, **c} for n, c in stages_record(2, 0.0)["components"].items()]
    as_list = stage_series([{"time": 0.0, "step": 2, "components": rows}])
    assert as_list == stage_series([stages_record(2, 0.0)])
    assert as_list["producer"]["tokens_per_s"] == ([2], [152.0]) and as_list["producer"]["busy"] == (
        [2],
        [pytest.approx(0.8)],
    )
