"""The prompt source: issues the dataset's prompts onto ``prompts``, gated by the trainer's pace,
and keeps the run's accounting ledger (:mod:`producers.ledger`).

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
(:func:`producers.sampling.temperature_at`: constant, or the ``sampling.temp_scheduler``
schedule), a pure function of the step, so a re-issued prompt keeps its temperature.

Online evaluation (:mod:`producers.eval_rounds`): eval round ``r``'s prompts are queued, all at
once, as soon as ``policy_version >= r``, and go out before new training prompts (after pending
re-issues). They are not ledger prompts: no step, no replacement, no accounting; an outcome report
for an eval id is ignored. Each queued round is journaled as a ledger note, so a restarted or
resumed source never issues it again.

The gate's rules for producers that come and go (restarts, ``busctl scale``) are in
:mod:`producers.applied_versions`.

Accounting. Every issue and every outcome (``groups.trained`` from the trainer, ``groups.dropped``
from the packer and producers) goes through the :class:`producers.ledger.Ledger`, journaled to
``RUN_DIR/ledger.jsonl``. A restarted prompt source (``RLBUS_RESTARTS >= 1``) or a resumed run
(``RLBUS_RESUME=1``, or simply an existing journal: a fresh run starts in an empty run dir)
rebuilds the ledger, re-issues the prompts still without outcome first (same id and content: a
prompt is a pure function of its issue index; downstream dedupe by id makes a copy harmless), then
goes on issuing. A restarted source also restores the producers' applied versions journaled since
the run (re)started, because ``weights.applied`` is not re-announced by the hub; a resumed run
does not (its producers are new and announce again). ``accounting.json`` is written at most every
``Ledger.write_interval_s`` while running, on ``run.done`` and on close.

:class:`PromptSource` is the socket-free logic; :class:`PromptSourceProc` the process.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Callable

from prometheus_client import Counter, Gauge

from bus.component import Component, component_main
from bus.launch_env import ENV_RESTARTS, ENV_RESUME
from bus.messages import GroupsDropped, GroupsTrained, Prompt, RunDone, WeightsApplied
from bus.metrics import POLICY_VERSION
from producers.applied_versions import AppliedVersions, applied_since_start
from producers.eval_rounds import EvalRounds, build_eval_rounds, is_eval_id
from producers.ledger import OUTCOMES, Ledger
from producers.sampling import temperature_at
from producers.tasks import get_task, load_task_examples, render_messages

log = logging.getLogger(__name__)

PROMPTS_SENT = Counter("rlbus_prompt_source_prompts_total", "Prompts sent (re-issues included)")
PROMPTS_REPLACED = Counter("rlbus_prompt_source_replaced_total", "Replacements owed for prompts that did not train")
PROMPTS_REISSUED = Counter("rlbus_prompt_source_reissued_total", "Prompts re-sent with the same id after a restart")
EVAL_ROUNDS_ISSUED = Counter("rlbus_prompt_source_eval_rounds_total", "Online evaluation rounds issued")
GATED = Gauge("rlbus_prompt_source_gated", "1 while issuing waits for the trainer (async level reached)")
ACCOUNTING_ISSUED = Counter("rlbus_accounting_issued_total", "Distinct prompts issued in the run")
ACCOUNTING_OUTCOMES = Counter("rlbus_accounting_outcomes_total", "Prompts that reached an outcome", ["outcome"])
ACCOUNTING_UNRESOLVED = Gauge("rlbus_accounting_unresolved", "Issued prompts without an outcome yet")
for _outcome in OUTCOMES:
    ACCOUNTING_OUTCOMES.labels(_outcome)  # every outcome shows in /metrics from the start, at 0
# A restarted source starts these counters at the journal's totals (a counter reset to Prometheus).


def prompt_id(index: int) -> str:
    """The id of the prompt issued at ``index`` (``"p00000042"``)."""
    return f"p{index:08d}"


END_QUIET_S = 0.5
"""At run.done, outcome reports are drained until none arrived for this long, seconds."""

class PromptSource:
    """Decides which prompt to issue next and when, and records outcomes in the ledger.

    Args:
        examples: task examples ``{"id", "prompt", "info"}`` (cycled when exhausted).
        task: task name stamped on each prompt.
        prompts_per_step: groups per optimizer step. max_async_level: see module docstring.
        max_steps: steps of the run; no new prompt is issued for step >= max_steps.
        num_producers: producers started with the run (see :class:`AppliedVersions`).
        dead_after_s: see :class:`AppliedVersions`, seconds.
        ledger: the accounting ledger (default: a fresh in-memory one). A replayed ledger's
            unresolved prompts are re-issued first, ungated (they were admitted once; their step
            is unchanged and the packer's staleness filter still bounds their lag).
        clock: monotonic time in seconds (tests pass their own).
        system_prompt: system message of every training prompt (the task's), or None.
        temperature: ``step -> sampling temperature`` of training prompts (default: 1.0).
        eval_rounds: online evaluation rounds (default: none). Rounds the ledger journal lists
            as issued are marked issued.

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
        dead_after_s: float = 10.0,
        ledger: Ledger | None = None,
        clock: Callable[[], float] = time.monotonic,
        system_prompt: str | None = None,
        temperature: Callable[[int], float] | None = None,
        eval_rounds: EvalRounds | None = None,
    ) -> None:
        if not examples:
            raise ValueError("the task has no training examples")
        if prompts_per_step < 1 or max_steps < 1 or max_async_level < 0 or num_producers < 1:
            raise ValueError("prompts_per_step, max_steps and num_producers must be >= 1, max_async_level >= 0")
        self.examples = examples
        self.task = task
        self.prompts_per_step = prompts_per_step
        self.max_async_level = max_async_level
        self.max_steps = max_steps
        self.clock = clock
        self.applied = AppliedVersions(num_producers, dead_after_s)
        self.ledger = ledger if ledger is not None else Ledger()
        self.reissue: deque[str] = deque(self.ledger.unresolved())
        self.num_reissued = 0
        self.system_prompt = system_prompt
        self.temperature = temperature or (lambda step: 1.0)
        self.eval_rounds = eval_rounds
        if eval_rounds is not None:
            eval_rounds.issued.update(n["round"] for n in self.ledger.notes if n.get("event") == "eval_round")
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
        """Queue the prompts of every eval round the producers' version has reached (journaled)."""
        if self.eval_rounds is None:
            return
        for r in self.eval_rounds.due(self.policy_version):
            self.ledger.note("eval_round", round=r)
            prompts = self.eval_rounds.issue(r)
            self.eval_queue.extend(prompts)
            EVAL_ROUNDS_ISSUED.inc()
            log.info("eval round %d: %d prompts queued (policy version %d)", r, len(prompts), self.policy_version)

    def may_issue(self) -> bool:
        """True if a re-issue or an eval prompt is pending, or the next step is within the async
        level and the run."""
        if self._pending_reissue() is not None:
            return True
        self._queue_due_eval_rounds()
        if self.eval_queue:
            return True
        step = self.next_step
        return step < self.max_steps and self.policy_version >= step - self.max_async_level

    def issue(self) -> Prompt:
        """The next prompt: a pending re-issue, else an eval prompt, else a new one recorded in the
        ledger (call only when :meth:`may_issue`)."""
        assert self.may_issue()
        pid = self._pending_reissue()
        if pid is not None:
            self.reissue.popleft()
            self.num_reissued += 1
            rec = self.ledger.issued[pid]
            return self._build(rec.index, rec.step)
        if self.eval_queue:
            return self.eval_queue.popleft()
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
        conflicts and unknown ids owe none; eval ids are ignored: the packer counts them)."""
        return len(self.ledger.on_dropped([g for g in group_ids if not is_eval_id(g)], reason))


class PromptSourceProc(Component):
    """Process wrapper of :class:`PromptSource`: reliable sender ``prompts`` (bound), control SUB.

    ``prompts`` is at-least-once (:mod:`bus.courier`): ``send`` blocks while the outbox holds its
    bound of prompts not yet taken by a producer; a prompt held by a producer that dies is re-sent
    to another one by the courier.
    """

    def setup(self) -> None:
        cfg = self.cfg
        restarts, resume = self.launch.restarts, self.launch.resume
        task = get_task(cfg.task.name, cfg.task)
        examples = load_task_examples(task, "train", cfg.task.num_train_examples, cfg.task.seed)
        max_steps = cfg.trainer.max_steps
        self.ledger = Ledger(self.run_dir)
        self.source = PromptSource(
            examples,
            task=cfg.task.name,
            prompts_per_step=cfg.prompts_per_step,
            max_async_level=cfg.max_async_level,
            max_steps=max_steps,
            num_producers=cfg.producers.replicas,
            dead_after_s=cfg.bus.dead_after_s,
            ledger=self.ledger,
            system_prompt=task.system_prompt,
            temperature=lambda step: temperature_at(cfg.sampling, step, max_steps),
            eval_rounds=build_eval_rounds(cfg),
        )
        if self.ledger.replayed:
            log.info(
                "rebuilt from the journal (restarts=%d, resume=%s): %d issued, %d to re-issue, next step %d",
                restarts, resume, self.ledger.num_issued, len(self.source.reissue), self.source.next_step,
            )
            if restarts >= 1:
                self.source.restore_applied(applied_since_start(self.ledger.notes))
        elif resume or restarts:
            log.warning("%s/%s set but no ledger journal in %s: starting from scratch", ENV_RESTARTS, ENV_RESUME, self.run_dir)
        self.ledger.note("start", restarts=restarts, resume=resume)
        self._synced = {"issued": 0, "reissued": 0, **dict.fromkeys(OUTCOMES, 0)}
        self._sync_metrics()
        self.prompts = self.reliable_sender("prompts", self.endpoints.address("prompts"), bind=True)
        self.outcomes_in = self.reliable_receiver(
            "outcomes", self.endpoints.address("outcomes"), bind=True, accept=(GroupsDropped, GroupsTrained)
        )
        self.control = self.control_subscriber()
        self.pending: Prompt | None = None

    def _sync_metrics(self) -> None:
        """Bring the accounting metrics up to the ledger (counters by their increase since the last sync)."""
        now = {"issued": self.ledger.num_issued, "reissued": self.source.num_reissued, **self.ledger.counts}
        counters = {"issued": ACCOUNTING_ISSUED, "reissued": PROMPTS_REISSUED}
        for key, value in now.items():
            delta = value - self._synced[key]
            if delta:
                (counters[key] if key in counters else ACCOUNTING_OUTCOMES.labels(key)).inc(delta)
        self._synced = now
        ACCOUNTING_UNRESOLVED.set(len(self.ledger.open))
        POLICY_VERSION.set(self.source.policy_version)

    def _handle_control(self, timeout_s: float) -> bool:
        """Apply control messages; False once the run is done."""
        msg = self.control.recv(timeout_s=timeout_s)
        while msg is not None:
            if isinstance(msg, WeightsApplied):
                self.source.on_weights_applied(msg.producer, msg.version)
            elif isinstance(msg, RunDone):
                # the trainer sent run.done once its own outcomes were recorded; wait briefly for
                # reports of the other senders still on their way
                self._handle_outcomes(quiet_s=END_QUIET_S)
                return False
            msg = self.control.recv(timeout_s=0)
        return True

    def _handle_outcomes(self, quiet_s: float = 0.0) -> None:
        """Record every outcome report waiting on ``outcomes`` (journal first, then release it),
        until none has arrived for ``quiet_s`` seconds."""
        msg = self.outcomes_in.recv(timeout_s=quiet_s)
        while msg is not None:
            if isinstance(msg, GroupsTrained):
                self.source.on_trained(msg.group_ids)
            elif isinstance(msg, GroupsDropped):
                PROMPTS_REPLACED.inc(self.source.on_dropped(msg.group_ids, msg.reason))
            self.outcomes_in.done(msg.id)
            msg = self.outcomes_in.recv(timeout_s=quiet_s)

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.pending is None and self.source.may_issue():
                    self.pending = self.source.issue()
                GATED.set(self.pending is None)
                if self.pending is not None and self.prompts.send(self.pending, timeout_s=0.2):
                    PROMPTS_SENT.inc()
                    self.pending = None
                self._handle_outcomes()
                running = self._handle_control(timeout_s=0.2 if self.pending is None and not self.source.may_issue() else 0)
                self._sync_metrics()
                self.ledger.maybe_write_accounting()
                if not running:
                    log.info("run done: accounting %s", {k: v for k, v in self.ledger.accounting().items() if k in ("issued", "outcomes")})
                    return
        finally:
            self.ledger.write_accounting()

    def close(self) -> None:
        ledger = getattr(self, "ledger", None)
        if ledger is not None:
            ledger.close()
        super().close()


if __name__ == "__main__":
    raise SystemExit(component_main(PromptSourceProc))
