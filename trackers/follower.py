"""The tracker follower: tails the run's JSONL files and hands what they gain to each tracker.

It runs in the tracker process, never in a pipeline component, so a slow or failing tracker costs the trainer
nothing. A tracker that raises is warned about once (also under ``failed`` in ``state.json``) and dropped; the
others go on. Malformed lines are counted and dropped. ``RUN_DIR/trackers/state.json`` keeps the byte offsets,
each tracker's state and whether the config was logged, so a restart or ``--resume`` continues the same tracker
runs. A samples table is logged once its step is complete (a later step's record, an unchanged file, or
:meth:`TrackerFollower.close`).
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

from runfiles.eval_records import EVAL_FILE
from trackers.base import Tracker
from trackers.records import SAMPLE_COLUMNS, JsonlTail, flatten_config, sample_row, split_metrics_record, stage_scalars
from trackers.state import read_tracker_state, tracker_state_path, write_tracker_state

log = logging.getLogger(__name__)

__all__ = ["SOURCES", "TRACKERS", "TrackerFollower"]

TRACKERS = {
    "tensorboard": "trackers.tensorboard_tracker:TensorBoardTracker",
    "wandb": "trackers.wandb_tracker:WandbTracker",
    "mlflow": "trackers.mlflow_tracker:MlflowTracker",
}
"""``report.trackers`` name -> ``module:class`` of its :class:`trackers.base.Tracker` (imported when used)."""

SOURCES = ("metrics.jsonl", EVAL_FILE, "stages.jsonl", "samples.jsonl")
"""The run-directory files the follower tails."""


def _tracker_class(name: str) -> type[Tracker]:
    """The tracker class of ``name``; ValueError for an unknown name, ImportError when its module fails."""
    if name not in TRACKERS:
        raise ValueError(f"unknown tracker {name!r} in report.trackers; known: {', '.join(TRACKERS)}")
    module, cls = TRACKERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


class TrackerFollower:
    """Feeds the trackers ``names`` (``report.trackers``) from the JSONL files of ``run_dir``; ``config``: the
    resolved config as a dict. A tracker whose construction fails is warned about and left out (:attr:`failed`)."""

    def __init__(self, run_dir: Path, names: list[str], config: dict) -> None:
        self.run_dir = Path(run_dir)
        self.state_path = tracker_state_path(self.run_dir)
        self.state = read_tracker_state(self.run_dir)
        self.failed: dict[str, str] = dict(self.state.get("failed", {}))
        offsets = self.state.get("offsets", {})
        self.tails = {src: JsonlTail(self.run_dir / src, int(offsets.get(src, 0))) for src in SOURCES}
        self._unusable = 0
        self._pending_step: int | None = None
        self._pending_rows: list[list] = []
        self.trackers: list[Tracker] = []
        saved = self.state.setdefault("trackers", {})
        for name in names:
            try:
                tracker = _tracker_class(name)(self.run_dir, config, saved.get(name, {}))
            except Exception as err:  # the library's own errors are not ours to list
                self._fail(name, err)
                continue
            self.trackers.append(tracker)
            saved[name] = tracker.state
            self.failed.pop(name, None)  # it failed in an earlier tracker process (before a resume) and works again
        logged = set(self.state.setdefault("config_logged", []))
        hparams = flatten_config(config)
        for tracker in [t for t in self.trackers if t.name not in logged]:
            if self._call(tracker, "log_config", hparams):
                logged.add(tracker.name)
        self.state["config_logged"] = sorted(logged)
        self._save_state()

    @property
    def malformed(self) -> int:
        """Lines dropped so far: not a JSON object (any file) or without a usable step."""
        return sum(t.malformed for t in self.tails.values()) + self._unusable

    def _save_state(self) -> None:
        self.state["offsets"] = {src: tail.offset for src, tail in self.tails.items()}
        self.state["failed"] = self.failed
        try:
            write_tracker_state(self.run_dir, self.state)
        except OSError as err:
            log.warning("could not write %s: %s", self.state_path, err)

    def _fail(self, name: str, err: BaseException) -> None:
        self.failed[name] = f"{type(err).__name__}: {err}"
        log.warning("tracker %s failed and is dropped; the run goes on without it: %s", name, self.failed[name])

    def _call(self, tracker: Tracker, method: str, *args: object) -> bool:
        """``tracker.method(*args)``; on any error: warn once, drop the tracker, return False."""
        if tracker not in self.trackers:
            return False
        try:
            getattr(tracker, method)(*args)
        except Exception as err:  # a tracker must never stop the follower
            self.trackers.remove(tracker)
            self._fail(tracker.name, err)
            return False
        return True

    def _log_all(self, method: str, *args: object) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, method, *args)

    def _flush_samples(self) -> None:
        if self._pending_step is not None and self._pending_rows:
            self._log_all("log_samples", self._pending_step, SAMPLE_COLUMNS, self._pending_rows)
        self._pending_step, self._pending_rows = None, []

    def poll(self) -> int:
        """Log every record added since the last poll; returns how many were read (OSError: retried next poll)."""
        read = 0
        for rec in [*self.tails["metrics.jsonl"].read(), *self.tails[EVAL_FILE].read()]:
            read += 1
            parsed = split_metrics_record(rec)
            if parsed is None:
                self._unusable += 1
                continue
            self._log_all("log_scalars", *parsed)
        for rec in self.tails["stages.jsonl"].read():
            read += 1
            parsed = stage_scalars(rec)
            if parsed is None:
                continue  # the first records have no throughput yet: nothing to log, not malformed
            self._log_all("log_scalars", "stages", *parsed)
        samples = self.tails["samples.jsonl"].read()
        if not samples:
            self._flush_samples()
        for rec in samples:
            read += 1
            parsed = sample_row(rec)
            if parsed is None:
                self._unusable += 1
                continue
            step, row = parsed
            if step != self._pending_step:
                self._flush_samples()
                self._pending_step = step
            self._pending_rows.append(row)
        if read:
            self._log_all("flush")
            self._save_state()
        return read

    def close(self) -> None:
        """Log the last pending samples table, close every tracker, save the state."""
        self._flush_samples()
        self._log_all("flush")
        self._log_all("close")
        self._save_state()
