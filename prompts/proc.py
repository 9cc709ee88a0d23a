"""The prompt source process (``python -m prompts.proc``): :class:`prompts.source.PromptSource` with a
reliable sender ``prompts`` (bound), a reliable receiver ``outcomes`` (bound), the control SUB and
PUB. A restarted or resumed source rebuilds from ``ledger.jsonl`` and re-issues what has no outcome;
a restarted one also restores the producers' applied versions journaled since the run started,
then hears their latest from the hub's catch-up (docs/ARCHITECTURE.md, "Lifecycle and healing").
"""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter, Gauge

from runfiles.checkpoints import checkpoint_step
from bus.component import Component, component_main
from lifecycle.launch_env import ENV_RESTARTS, ENV_RESUME
from bus.messages import (
    EvalResult,
    GroupsDropped,
    GroupsTrained,
    Prompt,
    RunDone,
    RunFinalStep,
    RunFinish,
    WeightsApplied,
    new_id,
)
from telemetry.metrics import POLICY_VERSION
from prompts.accounting import OUTCOMES, Ledger
from prompts.applied_versions import applied_since_start
from prompts.eval_rounds import build_eval_rounds
from prompts.source import PromptSource
from prompts.temperature import temperature_at
from tasks.registry import get_task, load_task_examples

log = logging.getLogger(__name__)

PROMPTS_SENT = Counter("rlbus_prompt_source_prompts_total", "Prompts sent (re-issues included)")
PROMPTS_REPLACED = Counter("rlbus_prompt_source_replaced_total", "Replacements owed for prompts that did not train")
PROMPTS_REISSUED = Counter("rlbus_prompt_source_reissued_total", "Prompts re-sent with the same id after a restart")
GATED = Gauge("rlbus_prompt_source_gated", "1 while issuing waits for the trainer (async level reached)")
ACCOUNTING_ISSUED = Counter("rlbus_accounting_issued_total", "Distinct prompts issued in the run")
ACCOUNTING_OUTCOMES = Counter("rlbus_accounting_outcomes_total", "Prompts that reached an outcome", ["outcome"])
ACCOUNTING_UNRESOLVED = Gauge("rlbus_accounting_unresolved", "Issued prompts without an outcome yet")
for _outcome in OUTCOMES:
    ACCOUNTING_OUTCOMES.labels(_outcome)  # every outcome shows in /metrics from the start, at 0
# A restarted source starts these counters at the journal's totals (a counter reset to Prometheus).

END_QUIET_S = 0.5
"""At run.done, outcome reports are drained until none arrived for this long, seconds."""
EVAL_FAILURES_EVERY_S = 5.0
"""Period of the re-announcement of failed eval groups of rounds without a result, seconds."""


class PromptSourceProc(Component):
    """Process wrapper of :class:`PromptSource`."""

    def setup(self) -> None:
        cfg = self.cfg
        restarts, resume = self.launch.restarts, self.launch.resume
        task = get_task(cfg.task.name, cfg.task)
        examples = load_task_examples(task, "train", cfg.task.num_train_examples, cfg.task.seed)
        max_steps = cfg.trainer.max_steps
        resume_step = checkpoint_step(self.run_dir) if resume else None
        self.ledger = Ledger(self.run_dir)
        self.source = PromptSource(
            examples,
            task=cfg.task.name,
            prompts_per_step=cfg.prompts_per_step,
            max_async_level=cfg.max_async_level,
            prefetch_steps=cfg.producers.prefetch_steps,
            max_steps=max_steps,
            num_producers=cfg.producers.replicas,
            dead_after_s=cfg.bus.dead_after_s,
            ledger=self.ledger,
            system_prompt=task.system_prompt,
            temperature=lambda step: temperature_at(cfg.sampling, step, max_steps),
            eval_rounds=build_eval_rounds(cfg),
            resume_step=resume_step,
            train=not cfg.eval.only,
        )
        if self.ledger.replayed:
            log.info(
                "rebuilt from the journal (restarts=%d, resume=%s): %d issued, %d to re-issue, next step %d",
                restarts,
                resume,
                self.ledger.num_issued,
                len(self.source.reissue),
                self.source.next_step,
            )
            if restarts >= 1:
                self.source.restore_applied(applied_since_start(self.ledger.notes))
        elif resume or restarts:
            log.warning(
                "%s/%s set but no ledger journal in %s: starting from scratch", ENV_RESTARTS, ENV_RESUME, self.run_dir
            )
        self.ledger.note("start", restarts=restarts, resume=resume, checkpoint_step=resume_step)
        self._synced = {"issued": 0, "reissued": 0, **dict.fromkeys(OUTCOMES, 0)}
        self._sync_metrics()
        self.prompts = self.reliable_sender("prompts", self.endpoints.address("prompts"), bind=True)
        self.outcomes_in = self.reliable_receiver(
            "outcomes", self.endpoints.address("outcomes"), bind=True, accept=(GroupsDropped, GroupsTrained)
        )
        self.control = self.control_subscriber()
        self.control_out = self.control_publisher()
        self.pending: Prompt | None = None
        self._failures_due = time.monotonic() + EVAL_FAILURES_EVERY_S

    def _reannounce_eval_failures(self) -> None:
        """Publish the failed eval groups of open rounds again: a restarted packer missed them."""
        now = time.monotonic()
        if now < self._failures_due:
            return
        self._failures_due = now + EVAL_FAILURES_EVERY_S
        ids = self.source.open_eval_failures()
        if ids:
            self.control_out.send(
                GroupsDropped(id=new_id(), group_ids=ids, reason="failed: announced again by the prompt source")
            )

    def _sync_metrics(self) -> None:
        """Bring the accounting metrics up to the ledger."""
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
            if isinstance(msg, WeightsApplied) and not self._known_applied(msg):
                self.source.on_weights_applied(msg.producer, msg.version)
            elif isinstance(msg, EvalResult):
                self.source.on_eval_result(msg.round, msg.task)
            elif isinstance(msg, RunFinish):  # busctl down --finish (repeated until our answer is heard)
                step = self.source.finish()
                log.info("finishing early: the run ends after step %d", step)
                self.control_out.send(RunFinalStep(id=new_id(), step=step))
            elif isinstance(msg, RunDone):
                # the trainer sent run.done once its own outcomes were recorded; wait briefly for
                # reports of the other senders still on their way
                self._handle_outcomes(quiet_s=END_QUIET_S)
                return False
            msg = self.control.recv(timeout_s=0)
        return True

    def _known_applied(self, msg: WeightsApplied) -> bool:
        """A repeat of the hub's catch-up: no news (a departed producer must not count again)."""
        return self.source.applied.version.get(msg.producer) == msg.version

    def _handle_outcomes(self, quiet_s: float = 0.0) -> None:
        """Record (journal, then release) outcome reports until none arrived for ``quiet_s``."""
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
                self._reannounce_eval_failures()
                running = self._handle_control(
                    timeout_s=0.2 if self.pending is None and not self.source.may_issue() else 0
                )
                self._sync_metrics()
                self.ledger.maybe_write_accounting()
                if not running:
                    log.info(
                        "run done: accounting %s",
                        {k: v for k, v in self.ledger.accounting().items() if k in ("issued", "outcomes")},
                    )
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
