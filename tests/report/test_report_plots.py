"""What ``busctl report``'s plots draw, read from the matplotlib axes (busctl.report_plots.build_figures):
throughput.png compares completion tokens/s of every stage (the trainer's from num_loss_tokens /
step_time_s, not its prompt + completion tokens_per_s), reward.png draws no line exactly on
another, and every legend sits outside the axes."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from busctl.report_plots import build_figures
from busctl.run_data import load_run, moving_average, smoothing_window
from busctl.throughput import LOSS_TOKENS, trainer_throughput


def write_run(run: Path, records: list[dict], stages: list[dict] | None = None) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if stages is not None:
        (run / "stages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stages))
    return run


def step(s: int, **extra: float) -> dict:
    """Training record of step ``s``: 600 prompt + 200 completion tokens in 0.5 + 0.1 * s seconds."""
    t = 0.5 + 0.1 * s
    return {
        "step": s,
        "reward_mean": 0.1 * s + 0.05 * (s % 3),
        "reward_std": 0.1,
        "num_tokens": 800.0,
        "num_loss_tokens": 200.0,
        "step_time_s": t,
        "tokens_per_s": 800.0 / t,
        **extra,
    }


def stage(s: int) -> dict:
    return {
        "step": s,
        "components": {
            "producer-0": {"role": "producer", "throughput": {"tokens_per_s": 300.0}, "busy": 0.9},
            "producer-1": {"role": "producer", "throughput": {"tokens_per_s": 100.0}, "busy": 0.5},
            "trainer": {"role": "trainer", "throughput": {"tokens_per_s": 250.0}, "busy": 1.0},
        },
    }


@pytest.fixture
def figures():
    made: list = []

    def build(run_dir: Path):
        figs, notes = build_figures(load_run(run_dir))
        made.extend(figs.values())
        return figs, notes

    yield build
    for fig in made:
        plt.close(fig)


def lines(ax) -> dict[str, tuple[list, list]]:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines()}


def assert_legends_outside(fig) -> None:
    fig.canvas.draw()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        assert legend.get_window_extent().x0 >= ax.get_window_extent().x1, f"legend of {ax.get_title()!r} over the axes"


def test_throughput_puts_completion_tokens_of_every_stage_on_one_axis(tmp_path, figures):
    records = [step(s) for s in range(1, 9)]
    figs, notes = figures(write_run(tmp_path / "run", records, [stage(s) for s in range(0, 9, 2)]))
    ax = figs["throughput.png"].axes[0]
    assert ax.get_ylabel() == "completion tokens/s"
    drawn = lines(ax)
    run_rate = 200.0 * len(records) / sum(r["step_time_s"] for r in records)  # the figure status and summary print
    trainer = drawn[f"trainer (loss tokens/s of step time; run: {run_rate:,.0f})"]
    assert trainer_throughput(records)[LOSS_TOKENS] == pytest.approx(run_rate)
    assert trainer[0] == list(range(1, 9))
    assert trainer[1] == pytest.approx([200.0 / r["step_time_s"] for r in records])
    assert all(v < r["tokens_per_s"] / 3 for v, r in zip(trainer[1], records))  # not the prompt + completion rate
    assert drawn["producer (stages.jsonl: completion tokens)"][1] == pytest.approx([400.0] * 5)  # replicas summed
    assert drawn["trainer (stages.jsonl: completion tokens)"][1] == pytest.approx([250.0] * 5)
    assert not [n for n in notes if n.startswith("throughput.png")]
    assert_legends_outside(figs["throughput.png"])


def test_throughput_of_a_run_without_loss_token_counts(tmp_path, figures):
    old = [{k: v for k, v in step(s).items() if k != "num_loss_tokens"} for s in range(1, 5)]
    figs, notes = figures(write_run(tmp_path / "with_stages", old, [stage(s) for s in range(0, 5, 2)]))
    assert set(lines(figs["throughput.png"].axes[0])) == {
        "producer (stages.jsonl: completion tokens)",
        "trainer (stages.jsonl: completion tokens)",
    }
    assert any("no num_loss_tokens" in n for n in notes)
    figs, _ = figures(write_run(tmp_path / "alone", old))  # nothing to compare with: tokens_per_s, named as such
    ((label, (_, y)),) = lines(figs["throughput.png"].axes[0]).items()
    assert "prompt + completion" in label and y == pytest.approx([r["tokens_per_s"] for r in old])


def test_reward_draws_no_line_on_another(tmp_path, figures):
    short = [step(s, **{"reward/gsm8k": step(s)["reward_mean"]}) for s in (1, 2, 3)]  # window 1, one term = reward_mean
    figs, _ = figures(write_run(tmp_path / "short", short))
    drawn = lines(figs["reward.png"].axes[0])
    assert list(drawn) == ["reward_mean (= reward/gsm8k)"]
    assert drawn["reward_mean (= reward/gsm8k)"][1] == pytest.approx([r["reward_mean"] for r in short])
    assert_legends_outside(figs["reward.png"])

    long = [
        step(s, **{"reward/a": 0.5 * step(s)["reward_mean"], "reward/b": step(s)["reward_mean"] + 0.01})
        for s in range(1, 25)
    ]
    figs, _ = figures(write_run(tmp_path / "long", long))
    w = smoothing_window(24)
    y = [r["reward_mean"] for r in long]
    drawn = lines(figs["reward.png"].axes[0])
    assert w > 1 and list(drawn) == [
        "reward_mean",
        f"reward_mean, {w}-step mean",
        f"reward/a, {w}-step mean",
        f"reward/b, {w}-step mean",
    ]
    assert drawn[f"reward_mean, {w}-step mean"][1] == pytest.approx(moving_average(y, w))
    assert drawn[f"reward/a, {w}-step mean"][1] == pytest.approx(moving_average([0.5 * v for v in y], w))
    series = [tuple(v[1]) for v in drawn.values()]
    assert len(set(series)) == len(series)  # no two lines with the same data
    assert_legends_outside(figs["reward.png"])
