"""The prompt source's logic (no sockets; the process is :mod:`prompts.proc`).

The k-th counted prompt belongs to step ``k // prompts_per_step`` and goes out only while
``policy_version >= step - max_async_level - prefetch_steps`` (the producers' applied version,
:mod:`prompts.applied_versions`; a producer holds a prefetched prompt until it runs ``step -
max_async_level``), so a sample's lag is at most ``max_async_level``. A prompt that does not train
stops counting: one replacement. Order: re-issues of a replayed ledger (same id and content, same
gate), then due eval rounds (:mod:`prompts.eval_rounds`), then new prompts. docs/ARCHITECTURE.md,
"Pace, staleness and accounting", has the story.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

from prometheus_client import Counter

from bus.eval_ids import is_eval_id, parse_eval_id
from bus.messages import Prompt
from prompts.accounting import Ledger
from prompts.applied_versions import AppliedVersions
from prompts.eval_rounds import EvalRounds
from tasks.task import render_messages

log = logging.getLogger(__name__)

EVAL_ROUNDS_ISSUED = Counter("rlbus_prompt_source_eval_rounds_total", "Online evaluation rounds issued")


def prompt_id(index: int) -> str:
    """``"p00000042"``."""
    return f"p{index:08d}"


class PromptSource:
    """Decides which prompt goes out next and when, and records outcomes in ``ledger`` (default: in
    memory; a replayed one's unresolved prompts are re-issued first). ``examples`` are cycled;
    ``temperature``: ``step -> temperature``; ``resume_step``: the checkpoint's step on ``--resume``;
    ``train`` False (``eval.only``): eval rounds only. ValueError for no examples or bad counts.
    """

    def __init__(
        self,
        examples: list[dict[str, Any]],
        *,
        task: str,
        prompts_per_step: int,
        max_async_level: int,
        max_steps: int,
        num_producers: int = 1,
        prefetch_steps: int = 0,
        dead_after_s: float = 10.0,
        ledger: Ledger | None = None,
        clock: Callable[[], float] = time.monotonic,
        system_prompt: str | None = None,
        temperature: Callable[[int], float] | None = None,
        eval_rounds: EvalRounds | None = None,
        resume_step: int | None = None,
        train: bool = True,
    ) -> None:
        if not examples:
            raise ValueError("the task has no training examples")
        if prompts_per_step < 1 or max_steps < 1 or max_async_level < 0 or num_producers < 1 or prefetch_steps < 0:
            raise ValueError(
                "prompts_per_step, max_steps and num_producers must be >= 1, max_async_level and prefetch_steps >= 0"
            )
        self.examples = examples
        self.task = task
        self.prompts_per_step = prompts_per_step
        self.max_async_level = max_async_level
        self.prefetch_steps = prefetch_steps
        self.max_steps = max_steps
        self.train = train
        self.clock = clock
        self.applied = AppliedVersions(num_producers, dead_after_s)
        self.ledger = ledger if ledger is not None else Ledger()
        self.reissue: deque[str] = deque(self.ledger.unresolved())
        self._fill_from = 0  # no step below it is short of live prompts (next_step scans up from it)
        self.num_reissued = 0
        self.system_prompt = system_prompt
        self.temperature = temperature or (lambda step: 1.0)
        self.eval_rounds = eval_rounds
        self.eval_reissue: set[int] = set()
        self.eval_failed: dict[int, set[str]] = {}  # round without result -> its failed eval group ids
        if eval_rounds is not None:
            self.eval_reissue = set(eval_rounds.restore(self.ledger.notes, resume_step))
            if self.eval_reissue:
                log.info(
                    "eval rounds %s were issued before the restart and have no result: issued again when due",
                    sorted(self.eval_reissue),
                )
        self.eval_queue: deque[Prompt] = deque()
        self.finished = False  # busctl down --finish: the final step is set
        if resume_step is None:  # a restart keeps an earlier busctl down --finish; a resume goes on
            for final in [n["step"] for n in self.ledger.notes if n.get("event") == "final_step"][-1:]:
                self.set_final_step(int(final))

    @property
    def policy_version(self) -> int:
        """The version every live producer runs."""
        return self.applied.policy_version(self.clock())

    @property
    def num_issued(self) -> int:
        """Distinct prompts issued."""
        return self.ledger.num_issued

    @property
    def next_step(self) -> int:
        """The step of the next new prompt: the lowest step with fewer than ``prompts_per_step`` live prompts
        (issued, not failed, filtered or dropped). A drop's replacement goes to the step it left short, which an
        on-policy run (``max_async_level=0``) waits for while it holds prefetched later steps."""
        step, live = self._fill_from, self.ledger.live_per_step
        while live[step] >= self.prompts_per_step:
            step += 1
        self._fill_from = step
        return step

    def finish(self) -> int:
        """``busctl down --finish``: the run ends after the steps whose prompts are issued, i.e.
        ``ceil((issued - not trained) / prompts_per_step)`` (at least 1, at most ``max_steps``); journaled.
        Returns that final step; a repeated request gets the same answer."""
        if self.finished or not self.train:
            return self.max_steps
        live = self.ledger.num_issued - self.ledger.num_not_trained
        step = max(1, min(self.max_steps, -(-live // self.prompts_per_step)))
        if step < self.max_steps:
            self.ledger.note("final_step", step=step)
        self.set_final_step(step)
        return step

    def set_final_step(self, step: int) -> None:
        """End the run after ``step`` (only ever lowers ``max_steps``): prompts of later steps are not
        issued, the final eval round moves to ``step``."""
        self.finished = True
        if step < self.max_steps:
            self.max_steps = step
            if self.eval_rounds is not None:
                self.eval_rounds.finish_at(step)

    def _pending_reissue(self) -> str | None:
        """The next id to re-issue, skipping resolved ones."""
        while self.reissue and self.reissue[0] in self.ledger.outcomes:
            self.reissue.popleft()
        return self.reissue[0] if self.reissue else None

    def _queue_due_eval_rounds(self) -> None:
        """Queue and journal the due eval rounds; round 0 waits for the first step's training prompts."""
        if self.eval_rounds is None:
            return
        training_started = not self.train or self.next_step >= min(1, self.max_steps)
        for r in self.eval_rounds.due(self.policy_version):
            if r == 0 and not training_started:
                continue
            self.ledger.note("eval_round", round=r)
            prompts = self.eval_rounds.issue(r)
            self.eval_queue.extend(prompts)
            EVAL_ROUNDS_ISSUED.inc()
            again = " again (issued before a restart, no result)" if r in self.eval_reissue else ""
            log.info(
                "eval round %d: %d prompts queued%s (policy version %d)", r, len(prompts), again, self.policy_version
            )

    def on_eval_result(self, round_: int, task: str) -> None:
        """Journal the round done once every eval task's result was seen."""
        if self.eval_rounds is not None and self.eval_rounds.on_result(round_, task):
            self.ledger.note("eval_done", round=round_)
            self.eval_reissue.discard(round_)
            self.eval_failed.pop(round_, None)

    def _admitted(self, step: int) -> bool:
        """``policy_version >= step - max_async_level - prefetch_steps``."""
        return self.policy_version >= step - self.max_async_level - self.prefetch_steps

    def may_issue(self) -> bool:
        """True if an admitted re-issue, an eval prompt or an admitted new step is pending."""
        pid = self._pending_reissue()
        if pid is not None and self._admitted(self.ledger.issued[pid].step):
            return True
        self._queue_due_eval_rounds()
        if self.eval_queue:
            return True
        step = self.next_step
        return self.train and pid is None and step < self.max_steps and self._admitted(step)

    def issue(self) -> Prompt:
        """The next prompt (call only when :meth:`may_issue`); a new one is journaled first."""
        assert self.may_issue()
        pid = self._pending_reissue()
        if pid is not None and self._admitted(self.ledger.issued[pid].step):
            self.reissue.popleft()
            self.num_reissued += 1
            rec = self.ledger.issued[pid]
            return self._build(rec.index, rec.step)
        if self.eval_queue:
            return self.eval_queue.popleft()
        assert pid is None, "new prompts wait for the re-issues"
        index, step = self.ledger.num_issued, self.next_step
        self.ledger.issue(prompt_id(index), index, step)  # journaled before it can be sent
        return self._build(index, step)

    def _build(self, index: int, step: int) -> Prompt:
        ex = self.examples[index % len(self.examples)]
        return Prompt(
            id=prompt_id(index),
            index=index,
            step=step,
            task=self.task,
            messages=render_messages(ex, self.system_prompt),
            info=dict(ex["info"]),
            temperature=self.temperature(step),
        )

    def on_weights_applied(self, producer: str, version: int) -> None:
        """``producer`` now runs ``version`` (journaled)."""
        self.applied.announce(producer, version, self.clock())
        self.ledger.note("applied", producer=producer, version=version)

    def restore_applied(self, announcements: list[tuple[str, int]]) -> None:
        """Replay ``(producer, version)`` announcements, oldest first, as if made now."""
        now = self.clock()
        for producer, version in announcements:
            self.applied.announce(producer, version, now)

    def on_trained(self, group_ids: list[str]) -> int:
        """Outcome ``trained``; returns how many were newly resolved (eval ids ignored)."""
        return len(self.ledger.on_trained([g for g in group_ids if not is_eval_id(g)]))

    def on_dropped(self, group_ids: list[str], reason: str) -> int:
        """``group_ids`` will never train; returns the replacements owed (one per newly resolved id).
        Eval ids are kept in :attr:`eval_failed` while their round has no result."""
        if self.eval_rounds is not None:
            for gid in group_ids:
                parsed = parse_eval_id(gid)
                if parsed is not None and parsed[0] not in self.eval_rounds.done:
                    self.eval_failed.setdefault(parsed[0], set()).add(gid)
        resolved = self.ledger.on_dropped([g for g in group_ids if not is_eval_id(g)], reason)
        for gid in resolved:  # their steps are short again
            self._fill_from = min(self._fill_from, self.ledger.issued[gid].step)
        return len(resolved)

    def open_eval_failures(self) -> list[str]:
        """Failed eval groups of rounds without a result, sorted (announced again by :mod:`prompts.proc`)."""
        return sorted(g for ids in self.eval_failed.values() for g in ids)
