"""The tracker state file ``RUN_DIR/trackers/state.json`` (trackers/state.py): the one reader that
the tracker process, ``busctl up`` (the trackers that failed) and ``busctl report`` (each tracker's
run id) share, against a torn, corrupt or oddly shaped file; and the real follower starting the
run's files from the beginning when its state is unreadable."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tests.trackers.tracked_run import append, train_record
from trackers.follower import TrackerFollower
from trackers.launch import TrackerProcess
from trackers.opening import tracker_lines
from trackers.state import read_tracker_state, tracker_state_path, write_tracker_state

STATE = {
    "offsets": {"metrics.jsonl": 120, "stages.jsonl": 0, "samples.jsonl": 7},
    "trackers": {"mlflow": {"run_id": "abc", "tracking_uri": "http://mlflow:5000"}},
    "failed": {"wandb": "ImportError: no wandb"},
    "config_logged": ["mlflow"],
}


def test_a_written_state_reads_back_whole(tmp_path: Path) -> None:
    assert read_tracker_state(tmp_path) == {}  # a fresh run: no file, no warning
    write_tracker_state(tmp_path, STATE)
    assert tracker_state_path(tmp_path) == tmp_path / "trackers" / "state.json"
    assert read_tracker_state(tmp_path) == STATE


@pytest.mark.parametrize(
    "text",
    [json.dumps(STATE)[:40], "", "\xff\xfe garbage", "[1, 2]", "null"],
    ids=["torn", "empty", "not-json", "list", "null"],
)
def test_an_unusable_file_reads_as_empty_with_a_warning(tmp_path: Path, text: str, caplog) -> None:
    path = tracker_state_path(tmp_path)
    path.parent.mkdir()
    path.write_text(text, encoding="latin-1")
    with caplog.at_level(logging.WARNING, logger="trackers.state"):
        assert read_tracker_state(tmp_path) == {}
    (record,) = caplog.records
    assert str(path) in record.getMessage()


def test_sections_of_the_wrong_shape_are_dropped_and_named(tmp_path: Path, caplog) -> None:
    bad = {
        "offsets": {"metrics.jsonl": 5, "stages.jsonl": -1, "samples.jsonl": "12", "x": True},
        "trackers": {"mlflow": {"run_id": "abc"}, "wandb": "oops"},
        "failed": ["wandb"],
        "config_logged": ["mlflow", 3],
        "extra": 1,
    }
    write_tracker_state(tmp_path, bad)
    with caplog.at_level(logging.WARNING, logger="trackers.state"):
        state = read_tracker_state(tmp_path)
    assert state == {
        "offsets": {"metrics.jsonl": 5},
        "trackers": {"mlflow": {"run_id": "abc"}},
        "config_logged": ["mlflow"],
        "extra": 1,
    }
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "3 malformed entries of 'offsets'" in messages and "'failed' is a JSON list" in messages
    assert "1 malformed entries of 'trackers'" in messages and "1 malformed entries of 'config_logged'" in messages


def test_the_three_readers_survive_a_torn_state_file(tmp_path: Path) -> None:
    """The follower starts every file from the beginning; busctl's report and stop print what
    the run directory alone shows."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    append(run_dir / "metrics.jsonl", train_record(1), train_record(2))
    path = tracker_state_path(run_dir)
    path.parent.mkdir()
    path.write_text(json.dumps({**STATE, "offsets": {"metrics.jsonl": 10_000}})[:50])  # cut mid-write

    follower = TrackerFollower(run_dir, [], {})
    assert follower.poll() == 2  # both records: the torn offsets were not used
    follower.close()
    assert read_tracker_state(run_dir)["offsets"]["metrics.jsonl"] == (run_dir / "metrics.jsonl").stat().st_size

    path.write_text(
        '{"trackers": {"mlflow": {"run_id": "r1", "tracking_uri": "http://h:5000"}}, "failed": {"wandb": "boom"}'
    )
    assert tracker_lines(run_dir) == []  # torn: no run id to name, and no crash
    write_tracker_state(run_dir, STATE)
    assert tracker_lines(run_dir) == ["mlflow: run abc at http://mlflow:5000"]

    console = Console(record=True, width=200)
    stopped = TrackerProcess(_exited_process(), run_dir)
    assert stopped.stop(console) == 0
    assert "tracker wandb failed during the run and was dropped: ImportError: no wandb" in console.export_text()


def _exited_process() -> subprocess.Popen:
    """A real tracker-process stand-in that already exited with 0 (stop() then only reads the state)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc
