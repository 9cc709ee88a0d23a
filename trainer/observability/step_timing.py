"""Where each trainer step's wall time goes: ``time/<phase>_s`` per step in ``metrics.jsonl``, and the
counter ``rlbus_trainer_phase_seconds_total{phase}`` (``rate()`` of it: the share of wall time).

Phases (:data:`PHASES`): ``wait_data`` (for the step's micro-batches), ``forward`` and ``backward``
(sums over micro-batches), ``optimizer`` (clip, stats all-gather, AdamW), ``weight_send`` (the
trainer thread's part of publishing) and ``bookkeeping``, the remainder: the six partition
``step_time_s``, so a step's records and checkpoint count in the next step's bookkeeping. On a GPU
forward, backward and optimizer are marked with CUDA events (:class:`PhaseMarks`), so the host does
not wait for the device at a phase boundary.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from prometheus_client import Counter

PHASES = ("wait_data", "forward", "backward", "optimizer", "weight_send", "bookkeeping")
"""The trainer's step phases, in loop order (see the module docstring)."""

SHARE_WINDOW = 10
"""Recent steps over which :meth:`StepPhases.recent_shares` measures the share of each phase."""

PHASE_SECONDS = Counter(
    "rlbus_trainer_phase_seconds_total",
    "Trainer wall time by phase, seconds: wait_data (for the step's micro-batches), forward, backward, "
    "optimizer (clip + AdamW), weight_send (the trainer thread's part of publishing weights), bookkeeping (the rest)",
    ["phase"],
)
for _phase in PHASES:  # every series from the start, at 0
    PHASE_SECONDS.labels(phase=_phase)


def phase_key(phase: str) -> str:
    """The metrics key of a phase's seconds: ``time/<phase>_s``."""
    return f"time/{phase}_s"


def share_key(phase: str) -> str:
    """The key of a phase's share of recent wall time (``trainer.step`` messages only): ``time_share/<phase>``."""
    return f"time_share/{phase}"


class PhaseMarks:
    """Phase boundaries of one trainer step, marked without making the host wait for the device:
    on CUDA a mark is a timing event the device stamps when it reaches it (read by :meth:`seconds`
    after the work), elsewhere ``time.perf_counter()``.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._marks: list = []

    def mark(self) -> int:
        """Mark the current point of the queued work; returns the mark's index."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def seconds(self, start: int, end: int) -> float:
        """Seconds between marks ``start`` and ``end`` (on CUDA: waits until the device reached ``end``)."""
        if not self.cuda:
            return self._marks[end] - self._marks[start]
        self._marks[end].synchronize()
        return self._marks[start].elapsed_time(self._marks[end]) / 1000.0


class StepPhases:
    """Splits the trainer loop's wall time into :data:`PHASES`: :meth:`wait_started` and
    :meth:`wait_ended` around collecting a step's micro-batches, :meth:`finish` once its weights are
    handed off. The trainer's thread only."""

    def __init__(self) -> None:
        self.mark = time.perf_counter()
        """When the previous step finished (or the loop started), ``perf_counter`` seconds."""
        self._wait_from = self.mark
        self._wait_s = 0.0
        self.recent: deque[dict[str, float]] = deque(maxlen=SHARE_WINDOW)
        """Phase seconds of the last :data:`SHARE_WINDOW` steps, oldest first."""

    def wait_started(self) -> None:
        """The loop starts collecting the next step's micro-batches."""
        self._wait_from = time.perf_counter()

    def wait_ended(self) -> None:
        """The step's micro-batches are all here."""
        self._wait_s = time.perf_counter() - self._wait_from

    def finish(self, step_metrics: dict[str, float], weight_send_s: float) -> tuple[float, dict[str, float]]:
        """Close the step: returns ``(step_time_s, {"time/<phase>_s": seconds})`` for the six
        phases (forward, backward and optimizer from ``step_metrics``, a missing one 0; bookkeeping
        the remainder, at least 0), and adds them to the counter and the recent window."""
        now = time.perf_counter()
        step_s, self.mark = now - self.mark, now
        times = {"wait_data": self._wait_s, "weight_send": weight_send_s}
        for phase in ("forward", "backward", "optimizer"):
            times[phase] = float(step_metrics.get(phase_key(phase), 0.0))
        times["bookkeeping"] = max(0.0, step_s - sum(times.values()))
        self._wait_s = 0.0
        self.recent.append(times)
        for phase in PHASES:
            PHASE_SECONDS.labels(phase=phase).inc(times[phase])
        return step_s, {phase_key(p): times[p] for p in PHASES}

    def recent_shares(self) -> dict[str, float]:
        """``{"time_share/<phase>": fraction}`` of the wall time of the last :data:`SHARE_WINDOW`
        steps (fractions sum to 1); empty before the first step or if no time passed."""
        total = sum(sum(t.values()) for t in self.recent)
        if total <= 0:
            return {}
        return {share_key(p): sum(t[p] for t in self.recent) / total for p in PHASES}
