"""Where each trainer step's wall time goes: phase times per step, in ``metrics.jsonl`` and Prometheus.

Phases (seconds per step; their keys in a step's metrics are ``time/<phase>_s``):

- ``wait_data``: from the end of the previous step's work to having all micro-batches of this
  step (:meth:`trainer.proc.TrainerProc.receive_step`; eval records are written by their own thread, not here);
- ``forward``: the packed forward and the loss of every micro-batch (sum over micro-batches);
- ``backward``: ``loss.backward()`` of every micro-batch (sum; under DDP the last one all-reduces);
- ``optimizer``: gradient clipping, the stats all-gather of data parallelism, the AdamW step;
- ``weight_send``: the trainer thread's part of publishing the new weights
  (:meth:`trainer.publish.WeightPublisher.publish`; a broadcast's bytes move in the background);
- ``bookkeeping``: the rest of the loop: step stats, the ``metrics.jsonl`` and
  ``trained_samples.jsonl`` appends, checkpoints, custody releases, Prometheus and control messages.

Invariant: the six phases partition the step's ``step_time_s`` (the time between two marks taken
right after each step's weights were handed off): ``bookkeeping`` is the remainder, so a step's
records and checkpoint are counted in the NEXT step's ``bookkeeping`` (they are written after the
mark). Forward/backward/optimizer come from :meth:`trainer.trainer.Trainer.step`, which marks each
boundary with a CUDA timing event (:class:`PhaseMarks`) so kernels are charged to the phase that
queued them without the host waiting for the device at every boundary.

Prometheus: ``rlbus_trainer_phase_seconds_total{phase}``, a counter of seconds per phase, the
standard shape for "time spent in X" (like ``node_cpu_seconds_total{mode}``): ``rate()`` of it is
the fraction of wall time per phase and a stacked panel of the six sums to ~1, with no bucket
series; per-step distributions are in ``metrics.jsonl``.

What bookkeeping does where: the per-step items stay on the trainer thread, each well under a
millisecond on the default job (the ``metrics.jsonl`` and ``trained_samples.jsonl`` appends, the
step ledger, the gauges); a periodic checkpoint copies the state here and writes and fsyncs it
on a background thread (:mod:`trainer.state.background_save`), since its files and fsyncs take tens
to hundreds of milliseconds on a busy disk. ``time/bookkeeping_s`` shows what it costs in a run.
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
    """Phase boundaries of one trainer step, marked without making the host wait for the device.

    On CUDA each :meth:`mark` records a timing event on the current stream (``torch.cuda.Event``):
    the device stamps it when it reaches that point of the queued work, so the host goes on
    queueing kernels; :meth:`seconds` reads the stamps after the step's work is done (it waits
    for the last mark). Elsewhere a mark is ``time.perf_counter()`` (the work is done when the call
    returns). A phase is then charged the device time of the kernels queued between its marks.
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
    """Splits the trainer loop's wall time into :data:`PHASES` (see the module docstring).

    Per step: :meth:`wait_started` and :meth:`wait_ended` around collecting the micro-batches, then
    :meth:`finish` once the weights are handed off. Not thread-safe (the trainer's thread only).
    """

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
        """Close the step: its wall time since the previous mark and its phase seconds.

        Args:
            step_metrics: :meth:`trainer.trainer.Trainer.step`'s metrics (``time/forward_s``,
                ``time/backward_s``, ``time/optimizer_s``; a missing one counts as 0).
            weight_send_s: seconds the trainer thread spent publishing the weights.

        Returns:
            ``(step_time_s, {"time/<phase>_s": seconds})`` for all six phases; ``bookkeeping`` is
            the remainder (clamped at 0), so the phases sum to ``step_time_s``. Also adds them to
            ``rlbus_trainer_phase_seconds_total`` and to the recent window.
        """
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
