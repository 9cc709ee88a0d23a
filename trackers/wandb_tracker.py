"""Weights & Biases: one W&B run per rlbus run, files under ``RUN_DIR/wandb/``.

Mode: ``WANDB_MODE`` when set (``offline``, ``online``, ``disabled``; W&B reads it itself);
otherwise ``online`` when an API key is set (``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE`` or
a ``~/.netrc`` entry for the W&B host, as ``wandb login`` writes) and ``offline`` when none is:
an offline run is written to ``RUN_DIR/wandb/offline-run-*`` and uploaded later with
``wandb sync RUN_DIR/wandb/offline-run-*``. Project: ``WANDB_PROJECT`` or ``rlbus``; run name:
the config's ``name``; the run id is kept in the tracker state, so ``busctl up --resume`` (or a
restarted tracker process) continues the same W&B run (``resume="allow"``).

What is logged: the resolved config as the run config; every record with its step under the key
``step``, which every metric uses as its x-axis (``define_metric("*", step_metric="step")``: eval
rounds arrive after later training steps, and W&B's own step must only grow); samples as a
``wandb.Table`` under ``samples``.
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
    """The ``mode`` to pass to ``wandb.init``: None when ``WANDB_MODE`` is set (W&B honours it),
    ``"offline"`` when no API key is configured (see the module docstring), else None (online)."""
    if environ.get("WANDB_MODE"):
        return None
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return None
    host = urlparse(environ.get("WANDB_BASE_URL") or DEFAULT_HOST).hostname or ""
    return None if _netrc_has(host, environ) else "offline"


class WandbTracker(Tracker):
    """Logs the run's records to a W&B run (see the module docstring).

    Raises:
        ImportError: wandb is not installed.
        wandb.Error: the run cannot start (e.g. online with a bad key).
    """

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
