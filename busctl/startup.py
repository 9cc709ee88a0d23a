"""Launch to first optimizer step: the start-up timeline of a ``busctl up``, in ``startup.json``.

"Launch" is the start of the ``busctl up`` process (:func:`process_started_at`; the supervisor's
construction time where that is unknown), so interpreter start-up, imports and the policy cache
check are counted. The supervisor calls :meth:`StartupClock.record` on the first
:class:`bus.messages.TrainerStep` it sees (the first optimizer step of this launch: step 1 of a
fresh run, ``N + 1`` of a resumed one); that writes ``RUN_DIR/startup.json``::

    {"launched_at": 1795545967.8,      # time.time() of the launch
     "first_step_s": 18.4,             # launch -> first optimizer step done, seconds
     "first_step": 1,                  # the trainer's step count in that TrainerStep
     "components": {"producer-0": {"spawned_s": 0.31, "ready_s": 17.2}, ...}}   # since launch

and gives the console line. ``busctl report`` prints ``first_step_s`` (:mod:`busctl.run_data`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from busctl.component_table import process_start_ticks
from busctl.run_status import write_json_atomic

if TYPE_CHECKING:
    from busctl.component_table import ComponentSpec

STARTUP_FILE = "startup.json"
"""Name of the start-up timeline file in the run directory."""


def process_started_at(pid: int) -> float | None:
    """``time.time()`` at which process ``pid`` started: now minus its age, the age being
    ``/proc/uptime`` less its ``/proc/PID/stat`` start ticks (both since boot; resolution one
    clock tick, 10 ms); None if unknown."""
    ticks = process_start_ticks(pid)
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if ticks is None else time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class StartupClock:
    """Times one launch to its first optimizer step (see the module docstring).

    Args:
        run_dir: where ``startup.json`` goes.
        launched_at: ``time.time()`` of the launch; None: now.

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
        """The first optimizer step (``step`` steps trained) is done now: write ``startup.json``
        with every component's spawn and ready times; returns the console line (rich markup)."""
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
