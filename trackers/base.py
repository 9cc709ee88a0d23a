"""The interface every experiment tracker implements.

Every method may raise anything (a missing library, a full disk, an unreachable server): the follower catches
it, warns once and drops the tracker.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["Tracker"]


class Tracker:
    """One experiment tracker fed by the tracker process, built once with the run directory (absolute), the resolved
    config as a dict, and ``state``: a small JSON-able dict the follower saves in ``RUN_DIR/trackers/state.json`` and
    hands back after a restart or ``--resume`` (e.g. the W&B or MLflow run id, so the same run continues)."""

    name = "tracker"

    def __init__(self, run_dir: Path, config: dict, state: dict) -> None:
        self.run_dir = run_dir
        self.config = config
        self.state = dict(state)

    def log_config(self, hparams: dict[str, str | int | float | bool]) -> None:
        """Record the resolved config as hyperparameters (``{"trainer.optim.lr": 1e-4, ...}``), once per tracker run."""
        raise NotImplementedError

    def log_scalars(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` at ``step``; ``kind``: ``"train"`` (a step record), ``"eval"`` (``eval/<task>/<metric>``,
        ``step`` = round) or ``"stages"``."""
        raise NotImplementedError

    def log_samples(self, step: int, columns: tuple[str, ...], rows: list[list]) -> None:
        """Record the examples of sampled step ``step`` (0-based) as a table of ``columns``."""
        raise NotImplementedError

    def flush(self) -> None:
        """Make what was logged so far durable (called after every round of new records)."""

    def close(self) -> None:
        """Finish the tracker run (end of the run or of the tracker process)."""
