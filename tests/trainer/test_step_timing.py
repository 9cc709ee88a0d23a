"""Where a trainer step's time goes (:mod:`trainer.observability.step_timing`): real optimizer steps of the tiny
random policy (:func:`policies.tiny_model.build_random_policy`) report their forward, backward and
optimizer seconds; the loop's six phases partition each step's wall time and feed
``rlbus_trainer_phase_seconds_total``; ``metrics.jsonl`` lines written as :mod:`trainer.proc`
writes them give ``busctl status``'s phase shares and ``busctl report``'s phase table and plot.

No timing assertions: only that the times exist, are >= 0 and add up as documented."""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from busctl.cli import main as busctl
from busctl.live import phase_shares, phase_text, trainer_text
from configs.schema import LoraSection
from policies.tiny_model import build_random_policy
from runfiles.jsonl import append_jsonl
from tests.trainer.test_trainer import micro_batches, samples, trainer_cfg
from trainer.observability.step_timing import PHASES, SHARE_WINDOW, StepPhases, phase_key, share_key
from trainer.state.model import load_policy
from trainer.trainer import Trainer

STEPS = 3
PHASE_RE = r"wait \d+% fwd \d+% bwd \d+% opt \d+% send \d+% other \d+%"


def counter(phase: str) -> float:
    return REGISTRY.get_sample_value("rlbus_trainer_phase_seconds_total", {"phase": phase}) or 0.0


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, list[dict], list[dict], dict[str, float]]:
    """A run directory with ``STEPS`` real steps' ``metrics.jsonl`` records, the records, the
    ``trainer.step`` message metrics, and the Prometheus counters' growth per phase."""
    tmp = tmp_path_factory.mktemp("phases")
    torch.manual_seed(0)
    model = load_policy(str(build_random_policy(tmp / "policy", seed=0)), LoraSection())
    trainer = Trainer(model, trainer_cfg())
    before = {p: counter(p) for p in PHASES}
    phases = StepPhases()
    records, messages = [], []
    run_dir = tmp / "run"
    run_dir.mkdir()
    for step in range(STEPS):
        phases.wait_started()
        mbs = micro_batches(samples(model, version=step), [[0, 1], [2], [3]], step=step)  # the "data" of this step
        phases.wait_ended()
        metrics = trainer.step(mbs)
        sent = time_of_weight_copy(model)
        step_s, times = phases.finish(metrics, sent)
        record = {"step": step + 1, **metrics, "weight_sync_s": sent, "step_time_s": step_s, **times}
        append_jsonl(run_dir / "metrics.jsonl", record)  # bookkeeping of this step: in the next one's
        records.append(record)
        messages.append({**record, **phases.recent_shares()})
    grown = {p: counter(p) - before[p] for p in PHASES}
    return run_dir, records, messages, grown


def time_of_weight_copy(model: torch.nn.Module) -> float:
    """Seconds to copy the weights into fresh buffers (what a weight sender's trainer-thread part does)."""
    started = time.perf_counter()
    _ = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return time.perf_counter() - started


def test_a_real_step_reports_forward_backward_and_optimizer_seconds(trained) -> None:
    _, records, _, _ = trained
    for r in records:
        times = [r[phase_key(p)] for p in ("forward", "backward", "optimizer")]
        assert all(t >= 0 for t in times), r
        assert r[phase_key("forward")] > 0 and r[phase_key("backward")] > 0  # three micro-batches ran
        assert sum(times) <= r["train_time_s"]  # parts of Trainer.step's own wall time
        assert r["train_time_s"] <= r["step_time_s"]


def test_the_six_phases_partition_each_step_and_feed_the_counter(trained) -> None:
    _, records, _, grown = trained
    for r in records:
        times = {p: r[phase_key(p)] for p in PHASES}
        assert all(t >= 0 for t in times.values()), times
        assert sum(times.values()) == pytest.approx(r["step_time_s"], rel=1e-9, abs=1e-9)
        assert times["weight_send"] == r["weight_sync_s"]
    for p in PHASES:  # the counter grew by exactly the recorded seconds
        assert grown[p] == pytest.approx(sum(r[phase_key(p)] for r in records), rel=1e-9, abs=1e-12)


def test_recent_shares_cover_the_window_and_sum_to_one(trained) -> None:
    _, records, messages, _ = trained
    last = messages[-1]
    shares = {p: last[share_key(p)] for p in PHASES}
    assert sum(shares.values()) == pytest.approx(1.0)
    total = sum(r["step_time_s"] for r in records[-SHARE_WINDOW:])
    for p in PHASES:
        assert shares[p] == pytest.approx(sum(r[phase_key(p)] for r in records[-SHARE_WINDOW:]) / total)
    phases = StepPhases()
    assert phases.recent_shares() == {}
    for _ in range(SHARE_WINDOW + 3):
        phases.finish({}, 0.0)
    assert len(phases.recent) == SHARE_WINDOW


def test_status_shows_the_share_of_each_phase(trained) -> None:
    _, records, messages, _ = trained
    m = messages[-1]
    text = phase_text(m)
    assert re.fullmatch(PHASE_RE, text), text
    percents = [int(x) for x in re.findall(r"(\d+)%", text)]
    assert percents == [round(100 * m[share_key(p)]) for p in PHASES]
    snap = {"step": STEPS, "max_steps": 10, "trainer_metrics": m, "eta_s": 5.0}
    assert trainer_text(snap).endswith(" | ETA 5s | " + text)
    # a step's record alone (no window): its own times over their sum
    own = phase_shares(records[0])
    assert list(own) == list(PHASES)
    assert own["backward"] == pytest.approx(records[0][phase_key("backward")] / records[0]["step_time_s"])
    assert phase_text({"reward_mean": 0.5}) == ""  # a trainer without phase times: nothing shown
    assert " | ETA" in trainer_text({**snap, "trainer_metrics": {"reward_mean": 0.5}})
    assert "ETA" not in trainer_text(snap, eta=False)  # busctl status of a run that has stopped


def test_report_prints_the_phase_table_and_plots_the_phases(trained, tmp_path: Path, capsys) -> None:
    run_dir, records, _, _ = trained
    out = tmp_path / "report"
    assert busctl(["report", str(run_dir), "--out", str(out)]) == 0
    summary = (out / "summary.txt").read_text()
    assert "trainer time per step by phase (mean s/step and its share of the mean step time, which add up" in summary
    wall = sum(r["step_time_s"] for r in records)
    means = []
    for p in PHASES:
        values = [r[phase_key(p)] for r in records]
        line = next(line for line in summary.splitlines() if line.strip().startswith(p + " "))
        means.append(statistics.mean(values))
        assert f"{means[-1]:8.4f} s" in line, line
        assert f"{100 * sum(values) / wall:5.1f}%" in line, line  # = the mean's share of the mean step time
        assert f"median {statistics.median(values):8.4f} s" in line, line
    assert sum(means) == pytest.approx(wall / len(records), rel=1e-6)  # the means add up to the mean step time
    png = out / "phases.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    pixels = matplotlib.image.imread(png)
    assert len(np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)) > 50, "phases.png looks blank"
