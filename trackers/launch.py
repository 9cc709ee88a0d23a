"""Start and stop the tracker process from ``busctl up`` (:func:`busctl.up_cli.supervise`).

:meth:`TrackerProcess.start` runs once ``config.yaml`` is written: it warns about a tracker whose library is
missing, then spawns ``python -m trackers`` in its own session (a Ctrl-C reaches busctl only), output to
``RUN_DIR/logs/trackers.log``. :meth:`TrackerProcess.stop` runs after every component stopped, so the files are
complete. Imports nothing heavy (busctl imports it on every ``up``).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from trackers.state import read_tracker_state

__all__ = ["LIBRARIES", "STOP_TIMEOUT_S", "TrackerProcess", "missing_libraries"]

STOP_TIMEOUT_S = 60.0
"""Longest wait for the tracker process to drain and close its trackers at the end of a run, seconds
(an online W&B run uploads what is left then; an offline one is done in seconds)."""

LIBRARIES = {"tensorboard": ("torch", "tensorboard"), "wandb": ("wandb",), "mlflow": ("mlflow",)}
"""The modules each tracker imports."""

REPO_ROOT = Path(__file__).resolve().parent.parent


def missing_libraries(names: list[str]) -> dict[str, str]:
    """``{tracker: module}`` for each tracker of ``names`` whose library cannot be found."""
    missing = {}
    for name in names:
        for module in LIBRARIES.get(name, ()):
            if importlib.util.find_spec(module) is None:
                missing[name] = module
                break
    return missing


class TrackerProcess:
    """The tracker process of one run: ``proc`` (the running ``python -m trackers``) on ``run_dir``."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path) -> None:
        self.proc = proc
        self.run_dir = run_dir

    @classmethod
    def start(cls, names: list[str], run_dir: Path, console: Console) -> TrackerProcess | None:
        """Spawn the tracker process for ``names`` on ``run_dir``; None when none is named or installed (each missing
        one is warned about)."""
        if not names:
            return None
        missing = missing_libraries(names)
        for name, module in missing.items():
            console.print(
                f"[yellow]report.trackers: {name} needs the Python module {module!r}, which is not installed "
                f"(pip install -e '.[trackers]'); the run goes on without it[/yellow]"
            )
        if len(missing) == len(names):
            return None
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        with open(run_dir / "logs" / "trackers.log", "ab", buffering=0) as logfile:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            logfile.write(f"===== rlbus {stamp}: starting trackers {', '.join(names)} =====\n".encode())
            proc = subprocess.Popen(
                [sys.executable, "-m", "trackers", "--run-dir", str(run_dir)],
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(run_dir),
                start_new_session=True,
            )
        running = ", ".join(n for n in names if n not in missing)
        console.print(f"trackers {running}: pid {proc.pid}, log {run_dir / 'logs' / 'trackers.log'}")
        return cls(proc, run_dir)

    def stop(self, console: Console, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """Ask the process to drain and close (SIGTERM), wait up to ``timeout_s``, then SIGKILL;
        name on ``console`` each tracker that failed. Returns the exit code (None: it was killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                console.print(
                    f"[yellow]trackers did not close within {timeout_s:g} s; killed "
                    f"(see {self.run_dir / 'logs' / 'trackers.log'})[/yellow]"
                )
                self.proc.kill()
                self.proc.wait()
                return None
        for name, error in read_tracker_state(self.run_dir).get("failed", {}).items():
            console.print(f"[yellow]tracker {name} failed during the run and was dropped: {error}[/yellow]")
        return self.proc.returncode
