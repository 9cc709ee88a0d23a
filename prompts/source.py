"""The prompt source: issues the dataset's prompts onto ``prompts``, gated by the trainer's pace,
and keeps the run's accounting ledger (:mod:`prompts.accounting`).

Pacing. Each optimizer step consumes ``prompts_per_step`` groups. The k-th *counted* prompt
belongs to step ``s = k // prompts_per_step``, and it is issued only while
``policy_version >= s - max_async_level``, where ``policy_version`` is the version that every
producer runs: the minimum over the producers' ``weights.applied`` announcements (the trainer's
version as the producers see it). Gating on what the producers have *applied*, not on what the
trainer has announced, makes the async level a real bound: a prompt of step ``s`` is sampled
under a version ``>= s - max_async_level``, so its off-policy lag at step ``s`` is at most
``max_async_level``. A prompt whose outcome is not ``trained`` (stale, filtered, failed) no longer
counts towards a step, so one replacement is issued for it. Issuing stops once the prompts for the
last step (``max_steps - 1``) are out; the source keeps running until ``run.done`` (the final
evaluation round is issued only once the producers run the last policy version).

Sampling temperature: each training prompt carries the temperature of its step
(:func:`prompts.temperature.temperature_at`: constant, or the ``sampling.temp_scheduler``
schedule), a pure function of the step, so a re-issued prompt keeps its temperature.

Online evaluation (:mod:`prompts.eval_rounds`): eval round ``r``'s prompts are queued, all at
once, as soon as ``policy_version >= r`` (the base-model round 0: once the first step's training
prompts are out, so the first batch is a training one), and go out before new training prompts
(after pending re-issues). They are not ledger prompts: no step, no replacement, no accounting; an outcome report
for an eval id is ignored. Each queued round, and each round whose results the packer published,
is journaled as a ledger note; a restarted or resumed source issues again the rounds issued
without a result (see :mod:`prompts.eval_rounds` for which policy they then score).

Prefetch (``producers.prefetch_steps``, ``prefetch_steps`` here): the source issues up to that many
steps beyond the gate above, and each producer enforces the gate itself, holding a training prompt
of step ``s`` until its own engine runs a version ``>= s - max_async_level``. The bound on lag is
the same; what changes is that the next step's prompts already sit at the producer when the
weights that admit them are applied.

The gate's rules for producers that come and go (restarts, ``busctl scale``) are in
:mod:`prompts.applied_versions`.

Accounting: every issue and every outcome goes through the :class:`prompts.accounting.Ledger`;
a ledger replayed from its journal makes the source re-issue the prompts still without outcome
first (same id and content: a prompt is a pure function of its issue index; downstream dedupe by
id makes a copy harmless), then go on issuing. Re-issues pass the same gate as new prompts (a
prompt of step ``s`` waits for ``policy_version >= s - max_async_level``) and the same
``prompts`` outbox bound, so a restart with many unresolved prompts does not flood the producers'
queues: the gate releases them step by step as the trainer advances.

:class:`PromptSource` is the socket-free logic; :class:`prompts.proc.PromptSourceProc` the process.
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
    """The id of the prompt issued at ``index`` (``"p00000042"``)."""
    return f"p{index:08d}"


class PromptSource:
    """Decides which prompt to issue next and when, and records outcomes in the ledger.

    Args:
        examples: task examples ``{"id", "prompt", "info"}`` (cycled when exhausted).
        task: task name stamped on each prompt.
        prompts_per_step: groups per optimizer step. max_async_level, prefetch_steps: see the module
            docstring (prefetch_steps > 0 needs producers that hold prompts, as rlbus's do).
        max_steps: steps of the run; no new prompt is issued for step >= max_steps.
        num_producers: producers started with the run (see :class:`AppliedVersions`).
        dead_after_s: see :class:`AppliedVersions`, seconds.
        ledger: the accounting ledger (default: a fresh in-memory one). A replayed ledger's
            unresolved prompts are re-issued first, ungated (they were admitted once; their step
            is unchanged and the packer's staleness filter still bounds their lag).
        clock: monotonic time in seconds (tests pass their own).
        system_prompt: system message of every training prompt (the task's), or None.
        temperature: ``step -> sampling temperature`` of training prompts (default: 1.0).
        eval_rounds: online evaluation rounds (default: none), restored from the ledger's journal
            (:meth:`EvalRounds.restore`: rounds done are skipped, rounds issued without a result
            are issued again).
        resume_step: the trainer checkpoint's step when the run is resumed (``--resume``), else None.
        train: issue training prompts; False (``eval.only``, ``busctl eval``): only the eval
            rounds, and round 0 does not wait for training prompts to be out.

    Raises:
        ValueError: no examples, or non-positive counts.
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

    @property
    def policy_version(self) -> int:
        """The version every live producer runs (see :class:`AppliedVersions`)."""
        return self.applied.policy_version(self.clock())

    @property
    def num_issued(self) -> int:
        """Distinct prompts issued (re-issues not counted)."""
        return self.ledger.num_issued

    @property
    def next_step(self) -> int:
        """The step the next new prompt would belong to: ``(issued - not trained) // prompts_per_step``."""
        return (self.ledger.num_issued - self.ledger.num_not_trained) // self.prompts_per_step

    def _pending_reissue(self) -> str | None:
        """The next id to re-issue, skipping ids that reached an outcome meanwhile."""
        while self.reissue and self.reissue[0] in self.ledger.outcomes:
            self.reissue.popleft()
        return self.reissue[0] if self.reissue else None

    def _queue_due_eval_rounds(self) -> None:
        """Queue the prompts of every eval round the producers' version has reached (journaled).
        The base-model round (0) waits until the first step's training prompts are out: training
        starts on the first batch, and the round still scores version 0 (an update waits for the
        eval groups in flight, :mod:`producers.eval_gate`; its ``version_min``/``max`` report it)."""
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
        """The packer published ``(round_, task)``'s result; journal the round done once every eval
        task's result was seen (a restarted source then never issues it again)."""
        if self.eval_rounds is not None and self.eval_rounds.on_result(round_, task):
            self.ledger.note("eval_done", round=round_)
            self.eval_reissue.discard(round_)
            self.eval_failed.pop(round_, None)

    def _admitted(self, step: int) -> bool:
        """A prompt of ``step`` may go out: ``policy_version >= step - max_async_level - prefetch_steps``
        (the producers hold a prefetched prompt until they run ``step - max_async_level``)."""
        return self.policy_version >= step - self.max_async_level - self.prefetch_steps

    def may_issue(self) -> bool:
        """True if a re-issue within the async level or an eval prompt is pending, or the next step
        is within the async level and the run. Re-issues (oldest first) pass the same gate as new
        prompts, so a restart does not send every unresolved prompt at once."""
        pid = self._pending_reissue()
        if pid is not None and self._admitted(self.ledger.issued[pid].step):
            return True
        self._queue_due_eval_rounds()
        if self.eval_queue:
            return True
        step = self.next_step
        return self.train and pid is None and step < self.max_steps and self._admitted(step)

    def issue(self) -> Prompt:
        """The next prompt: a pending re-issue, else an eval prompt, else a new one recorded in the
        ledger (call only when :meth:`may_issue`)."""
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
        """``producer`` now runs ``version`` (its newest announcement wins, also a lower one)."""
        self.applied.announce(producer, version, self.clock())
        self.ledger.note("applied", producer=producer, version=version)

    def restore_applied(self, announcements: list[tuple[str, int]]) -> None:
        """Replay ``announcements`` (``(producer, version)``, oldest first) as if made now: a
        restarted source, so a producer that was behind before the restart is behind again."""
        now = self.clock()
        for producer, version in announcements:
            self.applied.announce(producer, version, now)

    def on_trained(self, group_ids: list[str]) -> int:
        """Outcome ``trained`` for ``group_ids``; returns how many were newly resolved (eval ids
        are ignored)."""
        return len(self.ledger.on_trained([g for g in group_ids if not is_eval_id(g)]))

    def on_dropped(self, group_ids: list[str], reason: str) -> int:
        """``group_ids`` will never train (``reason``: ``"stale"``, ``"filtered: ..."``, ``"failed:
        ..."``, ...). Returns the replacements owed: one per newly resolved issued id (repeats,
        conflicts and unknown ids owe none; eval ids are not the ledger's: the packer counts them,
        and they are kept in :attr:`eval_failed` while their round has no result)."""
        if self.eval_rounds is not None:
            for gid in group_ids:
                parsed = parse_eval_id(gid)
                if parsed is not None and parsed[0] not in self.eval_rounds.done:
                    self.eval_failed.setdefault(parsed[0], set()).add(gid)
        return len(self.ledger.on_dropped([g for g in group_ids if not is_eval_id(g)], reason))

    def open_eval_failures(self) -> list[str]:
        """Failed eval groups of rounds without a result yet, sorted: the prompt source announces
        them again on the control channel (:mod:`prompts.proc`), since the packer counts failures
        from there and one restarted meanwhile missed the producer's announcement."""
        return sorted(g for ids in self.eval_failed.values() for g in ids)
