"""rlbus from Python: :func:`run` starts a job as ``busctl up`` does (the same checks, the same supervisor,
the same run directory) and returns where it ran and its final metrics, for a script or a notebook."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["RunError", "RunResult", "run"]


class RunError(RuntimeError):
    """``busctl up`` refused the job (``exit_code`` 2: config, devices, keys, names, run directory) or the
    run failed (1: a component); the message is the one ``busctl up`` prints."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclasses.dataclass(frozen=True)
class RunResult:
    """A finished run: ``run_dir`` (absolute), ``metrics``: its last training step's record of
    ``metrics.jsonl`` (``step``, ``loss``, ``reward/<name>``, ...), ``eval``: the last record of
    ``eval.jsonl`` (``eval/<task>/reward_mean``, ...; ``{}`` without eval)."""

    run_dir: Path
    metrics: dict[str, Any]
    eval: dict[str, Any]


class _Tee(io.TextIOBase):
    """Writes to ``stream`` and keeps a copy (``busctl up``'s error messages for :class:`RunError`)."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def _last(path: Path, key: str | None = None) -> dict[str, Any]:
    """The last JSON line of ``path`` (having ``key``), ``{}`` when there is none."""
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next((r for r in reversed(records) if key is None or key in r), {})


def run(
    config: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    launcher: str | None = None,
    console: Any = None,
) -> RunResult:
    """Run the job ``config`` (a YAML file; None: ``configs/reverse_text.yaml``) with ``overrides``
    (``["trainer.max_steps=3", ...]``, as on the command line) to its end: ``busctl up CONFIG OVERRIDES``,
    ``resume``/``overwrite``/``launcher`` its ``--resume``/``--overwrite``/``--launcher``, its output on
    ``console`` (a ``rich.console.Console``; default: standard output). Call it from the main thread (SIGINT
    and SIGTERM stop the run, as for ``busctl up``; the previous handlers are put back).

    Raises:
        configs.schema.ConfigError: an invalid config or override. RunError: busctl up refused the job or
        the run failed. KeyboardInterrupt: the run was interrupted (every component is stopped).
    """
    from rich.console import Console

    from busctl.up_cli import cmd_up, resume_config
    from configs.schema import load_config

    started = time.time()
    overrides = [str(o) for o in overrides or []]
    config = str(config) if config is not None else None
    cfg = resume_config(config, overrides) if resume else load_config(config, overrides)
    run_dir = Path(cfg.run_dir).resolve()
    ns = argparse.Namespace(
        args=[*([config] if config else []), *overrides],
        dry_run=False,
        launcher=launcher,
        address=None,
        resume=resume,
        overwrite=overwrite,
        launched_at=started,  # time to the first step counts from this call, not from the interpreter's start
    )
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stderr, sys.stderr = sys.stderr, _Tee(sys.stderr)
    try:
        code = cmd_up(ns, console or Console(soft_wrap=True))
    finally:
        copy, sys.stderr = sys.stderr.copy.getvalue(), stderr
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if code == 130:
        raise KeyboardInterrupt(f"run {run_dir} interrupted; every component stopped")
    if code != 0:
        status = run_dir / "status.json"
        error = json.loads(status.read_text()).get("error", "") if code == 1 and status.is_file() else ""
        raise RunError(error or copy.strip() or f"busctl up exited with code {code}", code)
    return RunResult(run_dir, _last(run_dir / "metrics.jsonl", "loss"), _last(run_dir / "eval.jsonl"))
