"""The tracker process as ``busctl up`` runs it (:class:`trackers.launch.TrackerProcess`): started on
a run directory, it logs records while they are written, drains the last ones on SIGTERM and
exits 0; a tracker whose library is missing is warned about before anything starts."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
from rich.console import Console

from tests.trackers.tracked_run import append, make_run_dir, read_tensorboard, sample_records, train_record
from trackers.launch import TrackerProcess, missing_libraries

pytest.importorskip("tensorboard", reason="the trackers extra is not installed")


def test_tracker_process_follows_the_run_and_drains_on_stop(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    make_run_dir(run_dir, ["tensorboard"])
    out = io.StringIO()
    console = Console(file=out, width=200)
    proc = TrackerProcess.start(["tensorboard"], run_dir, console)
    assert proc is not None
    try:
        append(run_dir / "metrics.jsonl", train_record(1))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (run_dir / "trackers" / "state.json").is_file():
            time.sleep(0.2)  # the process started and polled (it writes its state after each read)
        append(run_dir / "metrics.jsonl", train_record(2))
        append(run_dir / "samples.jsonl", *sample_records(0))
    finally:
        code = proc.stop(console, timeout_s=60)
    assert code == 0, (run_dir / "logs" / "trackers.log").read_text()
    got = read_tensorboard(run_dir)
    assert got["loss"] == pytest.approx({1: 1.0, 2: 0.5})  # step 2 written just before the stop: drained
    assert got["tables"] == {0: ["sihT-0-0", "sihT-0-1"]}
    assert "trackers tensorboard: pid" in out.getvalue() and "failed" not in out.getvalue()


def test_a_missing_library_is_warned_about_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert missing_libraries(["tensorboard", "wandb"]) == {"wandb": "wandb"}
    out = io.StringIO()
    assert TrackerProcess.start(["wandb"], tmp_path, Console(file=out, width=300)) is None  # nothing left to run
    assert "report.trackers: wandb needs the Python module 'wandb', which is not installed" in out.getvalue()
