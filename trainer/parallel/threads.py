"""The trainer's CPU threads follow the producers: few while they sample, all while they wait
(docs/ARCHITECTURE.md, "Trainer math"); the count changes float rounding only. With the producers
on other hosts, leave ``trainer.idle_threads`` at 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from prometheus_client import Counter, Gauge

__all__ = ["ThreadPlan"]

TRAINER_THREADS = Gauge("rlbus_trainer_threads", "torch CPU threads the trainer computes with now")
IDLE_MICRO_BATCHES = Counter(
    "rlbus_trainer_idle_thread_micro_batches_total",
    "Micro-batches trained with trainer.idle_threads (the producers had every step they may sample buffered)",
)


class ThreadPlan:
    """Picks the torch thread count before each micro-batch: ``idle`` once every step the producers
    may sample (the ``lookahead`` = ``max_async_level`` steps past the one trained, below
    ``max_steps``) is buffered, else ``sampling``. ValueError for a count < 1, ``lookahead`` < 0 or
    ``max_steps`` < 1."""

    def __init__(self, sampling: int, idle: int, lookahead: int, max_steps: int) -> None:
        if sampling < 1 or idle < 1 or lookahead < 0 or max_steps < 1:
            raise ValueError(
                f"need sampling, idle >= 1 threads, lookahead >= 0 and max_steps >= 1; got {sampling}, {idle}, "
                f"{lookahead}, {max_steps}"
            )
        self.sampling = sampling
        self.idle = idle
        self.lookahead = lookahead
        self.max_steps = max_steps
        self.idle_micro_batches = 0
        """Micro-batches chosen at ``idle`` threads since the last :meth:`take_idle_count`."""

    def choose(self, step: int, is_complete: Callable[[int], bool]) -> int:
        """``idle`` if every step in ``step + 1 .. step + lookahead`` (below ``max_steps``) is
        complete by ``is_complete(step) -> bool``, else ``sampling``."""
        ahead = range(step + 1, min(step + 1 + self.lookahead, self.max_steps))
        return self.idle if all(is_complete(s) for s in ahead) else self.sampling

    def apply(self, step: int, is_complete: Callable[[int], bool]) -> int:
        """:meth:`choose`, then ``torch.set_num_threads`` if that differs from now; returns it."""
        n = self.choose(step, is_complete)
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        TRAINER_THREADS.set(n)
        if n == self.idle and self.idle != self.sampling:
            self.idle_micro_batches += 1
            IDLE_MICRO_BATCHES.inc()
        return n

    def take_idle_count(self) -> int:
        """Micro-batches run at ``idle`` threads since the last call (then reset to 0)."""
        n, self.idle_micro_batches = self.idle_micro_batches, 0
        return n
