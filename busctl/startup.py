"""Launch to first optimizer step: the start-up timeline of a ``busctl up``, in ``startup.json``.

"Launch" is the start of the ``busctl up`` process (:func:`process_started_at`), so interpreter start-up and
imports count. On the first :class:`bus.messages.TrainerStep` of this launch the supervisor calls
:meth:`StartupClock.record`, which writes ``RUN_DIR/startup.json``: ``launched_at`` (``time.time()``),
``first_step_s`` (seconds), ``first_step`` and per component ``spawned_s`` / ``ready_s`` since launch.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from busctl.components.table import process_start_ticks
from busctl.run_status import write_json_atomic

if TYPE_CHECKING:
    from busctl.components.table import ComponentSpec

STARTUP_FILE = "startup.json"
"""Name of the start-up timeline file in the run directory."""


def process_started_at(pid: int) -> float | None:
    """``time.time()`` at which process ``pid`` started (``/proc/uptime`` less its start ticks; 10 ms resolution);
    None if unknown."""
    ticks = process_start_ticks(pid)
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if ticks is None else time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class StartupClock:
    """Times one launch (``launched_at``: ``time.time()``; None: now) to its first optimizer step.

    Attributes:
        first_step_s: seconds from launch to the first optimizer step; None until recorded.
    """

    def __init__(self, run_dir: Path, launched_at: float | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.launched_at = time.time() if launched_at is None else launched_at
        self._mono_at_launch = time.monotonic() - (time.time() - self.launched_at)
        self.first_step_s: float | None = None

    def since_launch(self, monotonic: float | None) -> float | None:
        """A ``time.monotonic()`` reading as seconds since the launch (None stays None)."""
        return None if monotonic is None else round(monotonic - self._mono_at_launch, 3)

    def record(self, step: int, table: list[ComponentSpec]) -> str:
        """The first optimizer step (``step`` steps trained) is done now: write ``startup.json``; returns the console
        line (rich markup)."""
        self.first_step_s = round(time.time() - self.launched_at, 3)
        components = {
            s.name: {"spawned_s": self.since_launch(s.spawned_at or None), "ready_s": self.since_launch(s.ready_at)}
            for s in table
        }
        write_json_atomic(
            self.run_dir / STARTUP_FILE,
            {
                "launched_at": self.launched_at,
                "first_step_s": self.first_step_s,
                "first_step": step,
                "components": components,
            },
        )
        ready = [(v["ready_s"], name) for name, v in components.items() if v["ready_s"] is not None]
        last = f"; last ready: {max(ready)[1]} at {max(ready)[0]:.1f} s" if ready else ""
        return f"  first optimizer step {self.first_step_s:.1f} s after launch{last} ({self.run_dir / STARTUP_FILE})"
