"""The interface every experiment tracker implements, and how a run names its trackers.

A tracker is built once per tracker process (:mod:`trackers.follower`) with the run directory
and the resolved config; the follower then hands it what the run's JSONL files gained
(:mod:`trackers.records`). Every method may raise anything (the library is missing, the disk is
full, the server is unreachable): the follower catches it, warns once and drops the tracker.

``state`` is a small JSON-able dict the follower saves in ``RUN_DIR/trackers/state.json`` and
gives back to the tracker after a restart or ``busctl up --resume`` (e.g. the W&B or MLflow run
id, so the same tracker run continues).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["Tracker"]


class Tracker:
    """One experiment tracker (TensorBoard, W&B, MLflow) fed by the tracker process.

    Args:
        run_dir: the run directory (absolute).
        config: the resolved config (``RUN_DIR/config.yaml`` as a dict).
        state: what :attr:`state` held when this run's tracker process last saved it (``{}`` at first).
    """

    name = "tracker"

    def __init__(self, run_dir: Path, config: dict, state: dict) -> None:
        self.run_dir = run_dir
        self.config = config
        self.state = dict(state)

    def log_config(self, hparams: dict[str, str | int | float | bool]) -> None:
        """Record the resolved config as hyperparameters (``{"trainer.optim.lr": 1e-4, ...}``),
        once per tracker run (the follower does not call it again after a resume)."""
        raise NotImplementedError

    def log_scalars(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` at ``step``; ``kind`` is ``"train"`` (a step record of metrics.jsonl),
        ``"eval"`` (an eval round: ``eval/<task>/<metric>``, ``step`` = round) or ``"stages"``
        (per-stage throughput of stages.jsonl)."""
        raise NotImplementedError

    def log_samples(self, step: int, columns: tuple[str, ...], rows: list[list]) -> None:
        """Record the examples of sampled step ``step`` (0-based) as a table of ``columns``."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was logged so far durable (called after every round of new records)."""

    def close(self) -> None:
        """Finish the tracker run (end of the run or of the tracker process)."""
