"""The trainer's custody bookkeeping, without sockets (the rule: docs/ARCHITECTURE.md, "The trainer
process"). Steps ``[0, covered)`` are covered by the last checkpoint (a re-sent micro-batch of them
is released at once, untrained); ``[covered, next_step)`` are trained, their message and group ids
kept until :meth:`StepLedger.cover`; ``[next_step, ...)`` are buffered until complete (in any order,
ahead of the step trained). A repeated message id counts once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bus.messages import MicroBatch

__all__ = ["CoveredStep", "StepLedger", "group_id"]


def group_id(sample_id: str) -> str:
    """The group of a sample id ``"{group_id}/{j}"``: everything before the last ``/`` (a sample
    id without ``/`` is its own group)."""
    return sample_id.rsplit("/", 1)[0]


def _group_ids(sample_ids: list[str]) -> list[str]:
    """Distinct group ids of ``sample_ids`` in first-seen order."""
    return list(dict.fromkeys(group_id(s) for s in sample_ids))


@dataclass
class CoveredStep:
    """A trained step a checkpoint now covers: release ``message_ids``, announce ``group_ids``
    (distinct, first-seen order)."""

    step: int
    message_ids: list[str]
    group_ids: list[str]


@dataclass
class _Pending:
    num_micro_batches: int
    parts: dict[int, MicroBatch] = field(default_factory=dict)
    ids: set[str] = field(default_factory=set)


class StepLedger:
    """Buffers micro-batches by step and says when their custody may be released; ``start_step``
    (>= 0, else ValueError): the step a (resumed) trainer trains next, those below it covered."""

    def __init__(self, start_step: int = 0) -> None:
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.covered = start_step
        """Steps below this are covered by a checkpoint."""
        self.next_step = start_step
        """The step to train next; steps in ``[covered, next_step)`` are trained, not covered."""
        self._pending: dict[int, _Pending] = {}
        self._uncovered: dict[int, tuple[set[str], list[str]]] = {}

    def offer(self, mb: MicroBatch) -> list[str]:
        """Take one received micro-batch; returns the ids to release now (``[mb.id]`` for a covered
        step). ValueError if it gives its step another micro-batch count than an earlier one."""
        if mb.step < self.covered:
            return [mb.id]
        if mb.step < self.next_step:  # trained, not covered: release with its step
            self._uncovered[mb.step][0].add(mb.id)
            return []
        pending = self._pending.setdefault(mb.step, _Pending(mb.num_micro_batches))
        if mb.num_micro_batches != pending.num_micro_batches:
            raise ValueError(
                f"micro-batch {mb.id!r} of step {mb.step} says {mb.num_micro_batches} micro-batches, "
                f"earlier ones of that step said {pending.num_micro_batches}"
            )
        pending.parts.setdefault(mb.micro_index, mb)
        pending.ids.add(mb.id)
        return []

    def take(self, step: int) -> list[MicroBatch] | None:
        """Step ``step``'s micro-batches in ``micro_index`` order once all arrived (it then counts as
        trained), else None. ValueError unless ``step`` is ``next_step``."""
        if step != self.next_step:
            raise ValueError(f"steps train in order: asked for step {step}, the next one is {self.next_step}")
        pending = self._pending.get(step)
        if pending is None or len(pending.parts) < pending.num_micro_batches:
            return None
        del self._pending[step]
        parts = [pending.parts[i] for i in range(pending.num_micro_batches)]
        self._uncovered[step] = (pending.ids, _group_ids([s for mb in parts for s in mb.sample_ids]))
        self.next_step = step + 1
        return parts

    def cover(self, num_steps: int) -> list[CoveredStep]:
        """A checkpoint now covers steps ``< num_steps``: returns the trained steps it newly covers,
        oldest first. ValueError beyond the trained steps or below the current coverage."""
        if not self.covered <= num_steps <= self.next_step:
            raise ValueError(f"cannot cover {num_steps} steps: {self.covered} are covered and {self.next_step} trained")
        out = []
        for step in sorted(s for s in self._uncovered if s < num_steps):
            ids, groups = self._uncovered.pop(step)
            out.append(CoveredStep(step, sorted(ids), groups))
        self.covered = num_steps
        return out

    def is_complete(self, step: int) -> bool:
        """True once every micro-batch of ``step`` (not yet taken) has arrived."""
        pending = self._pending.get(step)
        return pending is not None and len(pending.parts) == pending.num_micro_batches

    def buffered_steps(self) -> list[int]:
        """Steps with micro-batches waiting to be trained (complete or not), ascending."""
        return sorted(self._pending)
