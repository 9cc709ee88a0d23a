"""How to open what a run's trackers wrote: one command line per tracker (``busctl report`` prints them).

Read from the run directory alone (``tensorboard/``, ``wandb/``, ``mlruns/`` and the tracker
state ``trackers/state.json``), so it works on a finished run copied elsewhere; imports no
tracker library.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from trackers.state import read_tracker_state

__all__ = ["tracker_lines"]


def tracker_lines(run_dir: Path) -> list[str]:
    """A line per tracker the run used, with the command that opens it (``tensorboard --logdir ...``, ``wandb
    sync`` for every offline run directory, ``mlflow ui`` or the tracking URI and run id)."""
    run_dir = Path(run_dir)
    q = shlex.quote
    state = read_tracker_state(run_dir).get("trackers", {})
    lines = []
    if (run_dir / "tensorboard").is_dir():
        lines.append(f"tensorboard: tensorboard --logdir {q(str(run_dir / 'tensorboard'))}")
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    if offline:
        lines.append(f"wandb (offline; uploads to your W&B account): wandb sync {' '.join(q(str(p)) for p in offline)}")
    elif (run_dir / "wandb").is_dir():
        run_id = state.get("wandb", {}).get("run_id", "?")
        lines.append(
            f"wandb: online run {run_id} (its URL is in {run_dir / 'logs' / 'trackers.log'}); "
            f"files in {run_dir / 'wandb'}"
        )
    mlflow = state.get("mlflow", {})
    uri = mlflow.get("tracking_uri", "")
    if (run_dir / "mlruns").is_dir() and (not uri or uri.startswith("file:")):
        lines.append(
            "mlflow: MLFLOW_ALLOW_FILE_STORE=true mlflow ui "
            f"--backend-store-uri {q(str(run_dir / 'mlruns'))}  (pip install mlflow)"
        )
    elif uri:
        lines.append(f"mlflow: run {mlflow.get('run_id', '?')} at {uri}")
    return lines
