"""A tiny real component that does measurable work: a steady stream of samples for the metrics poller.

Run by the supervisor as ``python -m tests.terminal.ticker --run-dir DIR --name NAME ...`` through
:func:`bus.component.component_main`, like every real component, without any model. A component
named after a pipeline stage (``producer-0``, ``rewards-1``, ``packer``, ``trainer``) keeps a real
:class:`telemetry.metrics.StageMeter` of that stage busy for :data:`WORK_S`, then finishes one sample
of :data:`TOKENS_PER_SAMPLE` tokens and idles :data:`IDLE_S`, until stopped; it also reports
:data:`QUEUED` messages waiting in ``rlbus_bus_queued_messages``. Other names only idle.
"""

from __future__ import annotations

from bus.component import Component, component_main
from telemetry.metrics import BUS_QUEUED, STAGES, StageMeter

WORK_S, IDLE_S = 0.03, 0.01
"""Busy and idle time per sample, seconds: busy fraction WORK_S / (WORK_S + IDLE_S) = 0.75."""

TOKENS_PER_SAMPLE = 10
"""Completion tokens counted per finished sample."""

QUEUED = {("rollouts", "inbox"): 3, ("scored", "outbox_unfinished"): 4}
"""(topic, queue) -> messages reported waiting by a stage component (7 in all)."""


class Ticker(Component):
    """Finishes a sample every WORK_S + IDLE_S seconds in the stage its name names."""

    def setup(self) -> None:
        role = self.name.rpartition("-")[0] if self.name[-1].isdigit() else self.name
        self.meter = StageMeter(role) if role in STAGES else None
        if self.meter is not None:
            for (topic, queue), n in QUEUED.items():
                BUS_QUEUED.labels(topic, queue).set(n)

    def run(self) -> None:
        while self.meter is not None and not self.stop.is_set():
            with self.meter.work():
                self.stop.wait(WORK_S)
            self.meter.finished(1, TOKENS_PER_SAMPLE)
            self.stop.wait(IDLE_S)
        self.stop.wait()


if __name__ == "__main__":
    raise SystemExit(component_main(Ticker))
