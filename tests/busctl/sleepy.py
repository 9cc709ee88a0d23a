"""A tiny real component for supervisor tests: ready handshake, heartbeats, idles until stopped.

Run by the supervisor as ``python -m tests.busctl.sleepy --run-dir DIR --name NAME ...`` through
:func:`bus.component.component_main`, like every real component, but without any model. It logs
the ``RLBUS_*`` environment it got (tests read it from ``logs/NAME.log``). While the file
``RUN_DIR/hang-setup-NAME`` exists, ``setup()`` blocks until the process is stopped: the
component never gets ready. While ``RUN_DIR/hang-close-NAME`` exists, ``setup()`` starts a child
process in the component's process group (as vLLM's engine processes are) and ``close()`` never
returns: a stop that hangs.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time

from bus.component import Component, component_main
from lifecycle.launch_env import ENV_NAMES

log = logging.getLogger(__name__)


class Sleepy(Component):
    """Does nothing but live: ``run()`` returns only when stopped."""

    def setup(self) -> None:
        log.info("env %s", " ".join(f"{k}={os.environ.get(k, '')}" for k in ENV_NAMES))
        marker = self.run_dir / f"hang-setup-{self.name}"
        while marker.exists() and not self.stop.wait(0.1):
            pass
        if (self.run_dir / f"hang-close-{self.name}").exists():
            child = subprocess.Popen(["sleep", "1000"])
            log.info("child pid %d", child.pid)

    def close(self) -> None:
        while (self.run_dir / f"hang-close-{self.name}").exists():
            time.sleep(0.1)
        super().close()

    def run(self) -> None:
        self.stop.wait()


if __name__ == "__main__":
    raise SystemExit(component_main(Sleepy))
