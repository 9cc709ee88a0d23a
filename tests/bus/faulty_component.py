"""A real component whose courier's I/O loop keeps failing, for ``test_courier_faults.py``.

Run as ``python -m tests.bus.faulty_component --run-dir DIR --name NAME`` through
:func:`bus.component.component_main`, like every real component. ``setup()`` opens the receiving
side of ``prompts`` (as a producer does); ``run()`` makes ``bus.courier.MAX_LOOP_ERRORS`` commands
raise on the courier's I/O thread, one after the other, then waits for prompts like a producer's
main loop. The courier fails, ``recv`` raises :class:`bus.peers.CourierFailed`, and the process
must exit 1 (what makes its supervisor restart it).
"""

from __future__ import annotations

import logging

from bus.component import Component, component_main
from bus.courier import MAX_LOOP_ERRORS
from bus.messages import Prompt

log = logging.getLogger(__name__)


def _fault() -> None:
    raise RuntimeError("injected fault in the courier's I/O loop")


class Faulty(Component):
    """Opens ``prompts``, breaks its own courier, then receives until stopped."""

    def setup(self) -> None:
        self.prompts = self.reliable_receiver(
            "prompts", self.endpoints.address("prompts"), bind=False, accept=(Prompt,)
        )

    def run(self) -> None:
        for _ in range(MAX_LOOP_ERRORS):
            self.courier.command(_fault)
        while not self.stop.is_set():
            self.prompts.recv(timeout_s=0.2)


if __name__ == "__main__":
    raise SystemExit(component_main(Faulty))
