"""Weights & Biases: one W&B run per rlbus run, files under ``RUN_DIR/wandb/``.

Mode: ``WANDB_MODE`` when set, else online with an API key and offline without (:func:`wandb_mode`; upload later
with ``wandb sync``). The run id is kept in the tracker state, so a ``--resume`` continues the same W&B run. Every
metric's x-axis is the logged ``step`` (``define_metric("*", step_metric="step")``): eval rounds arrive after
later training steps, and W&B's own step must only grow.
"""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from urllib.parse import urlparse

from trackers.base import Tracker

__all__ = ["WandbTracker", "wandb_mode"]

DEFAULT_PROJECT = "rlbus"
DEFAULT_HOST = "https://api.wandb.ai"


def _netrc_has(host: str, environ: dict[str, str]) -> bool:
    """Whether the user's netrc (``environ["NETRC"]`` or ``~/.netrc``) holds a password for ``host``."""
    path = environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def wandb_mode(environ: dict[str, str]) -> str | None:
    """The ``mode`` to pass to ``wandb.init``: ``"offline"`` when neither ``WANDB_MODE`` nor an API key
    (``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE`` or a netrc entry for the W&B host) is set, else None."""
    if environ.get("WANDB_MODE"):
        return None
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(environ.get("WANDB_BASE_URL") or DEFAULT_HOST).hostname or ""
    return None if _netrc_has(host, environ) else "offline"


class WandbTracker(Tracker):
    """Logs the run's records to a W&B run; ImportError without wandb, ``wandb.Error`` when the run cannot start
    (e.g. online with a bad key)."""

    name = "wandb"

    def __init__(self, run_dir: Path, config: dict, state: dict) -> None:
        super().__init__(run_dir, config, state)
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=str(config.get("name") or run_dir.name),
            dir=str(run_dir),
            id=state.get("run_id"),
            resume="allow",
            mode=wandb_mode(dict(os.environ)),
            config=config,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.state["run_id"] = self.run.id

    def log_config(self, hparams: dict[str, str | int | float | bool]) -> None:
        pass  # wandb.init(config=...) recorded the nested config (W&B flattens it in its UI)

    def log_scalars(self, kind: str, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def log_samples(self, step: int, columns: tuple[str, ...], rows: list[list]) -> None:
        self.run.log({"samples": self.wandb.Table(columns=list(columns), data=rows), "step": step})

    def close(self) -> None:
        self.run.finish()
