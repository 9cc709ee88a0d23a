"""The packer process: reliable ``scored`` in (bound) -> :class:`packer.packer.Packer` -> reliable
``batches`` out (bound). Drops go to the prompt source's ledger on ``outcomes`` (the scored group is
released once recorded) and to the control channel; eval groups go to
:class:`packer.evaluation.EvalAggregator`, whose closed rounds are written to ``eval.jsonl``
(:mod:`packer.eval_log`) and published as ``eval.result``.

A group is released upstream only once its decision is durable (:mod:`packer.spool`,
:mod:`packer.eval_spool`) and a step's plan is spooled before it is sent, so a restarted or resumed
packer rebuilds its state and sends unreleased steps again, identically. Custody, durability, resume
and eval re-publication: docs/ARCHITECTURE.md ("Lifecycle and healing", "Packer and trainer side").
"""

from __future__ import annotations

import contextlib
import logging
import time

from prometheus_client import Counter, Gauge, Histogram

from bus.component import Component, component_main
from bus.control import REANNOUNCE_DELAYS_S
from bus.messages import (
    EvalResult,
    GroupsDropped,
    GroupsTrained,
    MicroBatch,
    RunDone,
    ScoredGroup,
    WeightsReady,
    new_id,
)
from telemetry.metrics import StageMeter
from packer.eval_log import EvalLog, declare_pass_at_k
from packer.eval_spool import EvalSpool
from packer.evaluation import EvalAggregator, EvalDecision, RoundResult
from packer.packer import DUPLICATE, DropReason, Packer, padding_ratio
from packer.sample_log import SamplesLog
from packer.spool import SPOOL_DIR, Spool, checkpoint_step, trained_group_ids
from runfiles.eval_records import EVAL_FILE

log = logging.getLogger(__name__)

GROUPS_IN = Counter(
    "rlbus_packer_groups_total", "Scored groups received, by decision (accepted, duplicate or drop reason)", ["outcome"]
)
STEPS_OUT = Counter("rlbus_packer_steps_total", "Optimizer steps emitted")
MICRO_BATCHES = Histogram(
    "rlbus_packer_micro_batches_per_step",
    "Micro-batches per emitted step",
    buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256),
)
POLICY_LAG = Histogram(
    "rlbus_packer_policy_lag_steps",
    "Off-policy lag of each emitted sample: step - oldest policy version, steps",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
)
PADDING = Gauge(
    "rlbus_packer_padding_ratio",
    "Unused share of the last emitted step's token budget: 1 - tokens / (micro-batches x micro_batch_tokens)",
)
BUFFERED = Gauge("rlbus_packer_buffered_groups", "Groups waiting for the next step")
EVAL_GROUPS = Counter(
    "rlbus_packer_eval_groups_total",
    "Scored eval groups received, by decision (taken, duplicate, late, invalid)",
    ["outcome"],
)
EVAL_RESULTS = Counter("rlbus_packer_eval_results_total", "EvalResults published (one per eval task per round)")
TAKE_BURST = 256
"""Most received groups decided on before their spool records are fsynced together and released."""
UNFINISHED = Gauge(
    "rlbus_packer_unfinished_micro_batches", "Micro-batches sent and not yet done by the trainer (checkpoint)"
)
SPOOL_TORN = Counter(
    "rlbus_packer_spool_torn_records_total", "Damaged spool tails dropped on opening (a write cut short by a crash)"
)
RESENT_STEPS = Counter(
    "rlbus_packer_resent_steps_total", "Planned, unreleased steps sent again from the spool after a restart or resume"
)
GROUP_OUTCOMES = ("accepted", DUPLICATE, *DropReason)
"""Every ``outcome`` of ``rlbus_packer_groups_total``."""
for _outcome in GROUP_OUTCOMES:
    GROUPS_IN.labels(_outcome)
for _outcome in EvalDecision:  # every ``outcome`` of rlbus_packer_eval_groups_total
    EVAL_GROUPS.labels(_outcome)


def observe_step(batches: list[MicroBatch], micro_batch_tokens: int) -> None:
    """Per emitted step: micro-batch count, padding ratio and each sample's policy lag."""
    MICRO_BATCHES.observe(len(batches))
    PADDING.set(padding_ratio(batches, micro_batch_tokens))
    for mb in batches:
        for version in mb.oldest_versions:
            POLICY_LAG.observe(mb.step - int(version))


class PackerProc(Component):
    """Process wrapper of :class:`Packer`."""

    def setup(self) -> None:
        cfg = self.cfg
        self.packer = Packer(
            cfg.prompts_per_step,
            cfg.packer.max_off_policy_steps,
            cfg.packer.micro_batch_tokens,
            filter_equal_rewards=cfg.packer.filter_equal_rewards,
            online_difficulty_filtering=cfg.filters.online_difficulty_filtering,
            teacher=bool(cfg.teacher.model_path),
        )
        first_step = checkpoint_step(self.run_dir) if self.launch.resume else 0
        self.spool = Spool(self.run_dir / SPOOL_DIR, first_step=first_step)
        SPOOL_TORN.inc(self.spool.torn_records)
        if first_step and not self.spool.existed:  # the lineage's trained groups are duplicates from now on
            trained = trained_group_ids(self.run_dir, first_step)
            self.spool.mark_seen(trained)
            log.info(
                "no spool to resume from: numbering steps from the checkpoint's step %d, %d group(s) trained "
                "below it marked seen",
                first_step,
                len(trained),
            )
        state = self.spool.state
        self.packer.restore(
            next_step=state.next_step, seen=state.seen, buffer=[state.groups[g] for g in state.buffered]
        )
        self.planned = [(step, [state.groups[g] for g in ids]) for step, ids in state.steps.items()]
        if self.spool.existed or first_step:
            log.info(
                "resumed from the spool: next step %d, %d group(s) seen, %d buffered, %d planned step(s) to send again",
                state.next_step,
                len(state.seen),
                len(state.buffered),
                len(self.planned),
            )
        self.evaluation = EvalAggregator()
        self.eval_spool = EvalSpool(self.run_dir / SPOOL_DIR, self.evaluation)
        SPOOL_TORN.inc(self.eval_spool.torn_records)
        if self.launch.resume:  # rounds above the checkpoint evaluated the lost lineage: evaluated again
            self.eval_spool.reset_above(first_step)
        self.eval_log = EvalLog(self.run_dir / EVAL_FILE, keep_through=first_step if self.launch.resume else None)
        for results in self.eval_spool.results.values():  # closed before a crash, maybe not yet in eval.jsonl
            for result in results:
                self._record_eval(result)
        declare_pass_at_k(cfg)
        if self.eval_spool.results or self.evaluation.rounds:
            log.info(
                "eval state from the spool: %d closed round(s) %s to publish again, %d open round(s) %s",
                len(self.eval_spool.results),
                sorted(self.eval_spool.results),
                len(self.evaluation.rounds),
                {r: len(st.received) + len(st.failed) for r, st in sorted(self.evaluation.rounds.items())},
            )
        self._answered_late: set[int] = set()
        self._trainer_version = -1  # newest weights.ready version seen (a drop: the trainer restarted)
        self._hub_reconnects = 0
        self._republish_at: list[float] = []
        self._schedule_republish("the packer restarted")
        self.meter = StageMeter("packer")
        self.samples_log = SamplesLog(
            self.run_dir / "samples.jsonl", cfg.report.samples_interval, cfg.report.samples_per_step
        )
        self.scored = self.reliable_receiver(
            "scored", self.endpoints.address("scored"), bind=True, accept=(ScoredGroup,)
        )
        self.batches = self.reliable_sender("batches", self.endpoints.address("batches"), bind=True)
        self.control_out = self.control_publisher()
        self.control_in = self.control_subscriber()
        self.outcomes = self.open_outcomes()

    def _announce_dropped(self, groups: list[ScoredGroup], reason: DropReason, upstream: tuple | None = None) -> None:
        """Report a drop to the ledger (``upstream`` released once recorded) and on the control channel."""
        if groups:
            GROUPS_IN.labels(reason).inc(len(groups))
            log.info("dropped %d group(s) as %s", len(groups), reason)
            msg = GroupsDropped(id=new_id(), group_ids=[g.id for g in groups], reason=reason)
            self.outcomes.send(msg, upstream=upstream)
            self.control_out.send(msg)

    def _publish_eval(self, closed: RoundResult | None) -> None:
        """Spool a closed round's results (durable first), write them to eval.jsonl, publish them."""
        if closed is None:
            return
        self.eval_spool.closed(closed)  # durable before published: a restart publishes the same again
        for result in closed.results:
            self._record_eval(result)
            self.control_out.send(result)
            EVAL_RESULTS.inc()
            log.info(
                "eval round %d, %s: %d samples, %d failed groups, %s (policy versions %d..%d)",
                result.round,
                result.task,
                result.num_samples,
                result.num_failed,
                result.metrics,
                result.version_min,
                result.version_max,
            )

    def _record_eval(self, result: EvalResult) -> None:
        """Append ``result`` to eval.jsonl; an I/O error is logged (the next start writes it from the spool)."""
        try:
            self.eval_log.write(result)
        except OSError:
            log.exception("could not write eval round %d of %s to %s", result.round, result.task, self.eval_log.path)

    def _republish_eval(self) -> None:
        """Publish the stored results again when due (after a restart of the packer, the trainer or the hub)."""
        if self.control_out.reconnects > self._hub_reconnects:
            self._hub_reconnects = self.control_out.reconnects
            self._schedule_republish("the control hub restarted")
        if self._republish_at and time.monotonic() >= self._republish_at[0]:
            self._republish_at.pop(0)
            for results in self.eval_spool.results.values():
                for result in results:
                    self.control_out.send(result)

    def _watch_trainer(self, version: int) -> None:
        """A ``weights.ready`` version lower than seen before (a restarted trainer): publish the results again."""
        if version < self._trainer_version:
            self._schedule_republish(f"the trainer went back to version {version} (from {self._trainer_version})")
        self._trainer_version = version

    def _schedule_republish(self, why: str) -> None:
        """Publish the stored results of closed rounds again now and at ``REANNOUNCE_DELAYS_S``."""
        if self.eval_spool.results:
            log.info("publishing %d stored eval round(s) again: %s", len(self.eval_spool.results), why)
            now = time.monotonic()
            self._republish_at = [now + d for d in (0.0, *REANNOUNCE_DELAYS_S)]

    def _answer_late(self, round_: int) -> None:
        """A group of closed round ``round_`` (re-issued by a restarted prompt source): publish its results, once."""
        if round_ not in self._answered_late:
            self._answered_late.add(round_)
            for result in self.eval_spool.results.get(round_, []):
                self.control_out.send(result)

    def _take_received(self, group: ScoredGroup) -> None:
        """Decide on ``group`` and the groups received after it (<= :data:`TAKE_BURST`), fsync their spool
        records once (group commit), then release the kept ones upstream."""
        release: list[str] = []
        with contextlib.ExitStack() as items:  # each group is one stage item, until it is released
            for n in range(TAKE_BURST):
                if n:
                    group = self.scored.recv(timeout_s=0)
                    if group is None:
                        break
                assert isinstance(group, ScoredGroup)
                items.enter_context(self.meter.work())
                if self._take(group):
                    release.append(group.id)
            self.spool.log.sync()
            self.eval_spool.log.sync()
            self.scored.done(*release)

    def _take(self, group: ScoredGroup) -> bool:
        """Decide on one group; True if the caller releases it once the spools are synced (not a drop)."""
        if group.is_eval:
            try:
                decision, closed = self.evaluation.add(group)
            except ValueError as exc:  # a malformed eval group must not stop training (nor loop on re-sends)
                log.error("eval group %s ignored: %s", group.id, exc)
                decision, closed = EvalDecision.INVALID, None
            EVAL_GROUPS.labels(decision).inc()
            if decision == EvalDecision.TAKEN:
                self.eval_spool.taken(group, sync=False)  # synced before custody is released upstream
            elif decision == EvalDecision.LATE:
                self._answer_late(group.eval_round)
            self._publish_eval(closed)  # a closed round's record is fsynced (with the groups before it)
            return True
        accepted, reason = self.packer.add(group)
        if accepted:
            self.meter.finished(group.group_size, int(group.completion_lens.sum()))
            self.spool.accepted(group, sync=False)  # synced before custody is released upstream
        if accepted or reason == DUPLICATE:
            GROUPS_IN.labels("accepted" if accepted else DUPLICATE).inc()  # a duplicate: no second outcome
            return True
        self._announce_dropped([group], reason, upstream=(self.scored, group.id))  # released once recorded
        return False

    def _run_done(self) -> bool:
        """Drain the control channel (counting failed eval groups); True once the run is done."""
        msg = self.control_in.recv(timeout_s=0)
        while msg is not None:
            if isinstance(msg, RunDone):
                return True
            if isinstance(msg, GroupsTrained):
                self._released(msg.step)
            if isinstance(msg, WeightsReady):
                self._watch_trainer(msg.version)
            if isinstance(msg, GroupsDropped):
                for closed in self.evaluation.add_failed(self.eval_spool.failed(msg.group_ids)):
                    self._publish_eval(closed)
            msg = self.control_in.recv(timeout_s=0)
        return False

    def _released(self, step: int) -> None:
        """Steps ``<= step`` released: mark them in the spool; compact it when due and no outcome report is in
        flight (a stale drop is announced again after a restart only while its group is in the spool)."""
        self.spool.released(step)
        if self.spool.should_compact() and self.outcomes.unfinished() == 0:
            self.spool.compact(buffered=[g.id for g in self.packer.buffer])

    def _send_step(self, batches: list[MicroBatch]) -> bool:
        """Send one step's micro-batches (blocking on the trainer's pace); False if stopped."""
        observe_step(batches, self.packer.micro_batch_tokens)
        for mb in batches:
            if not self.batches.send(mb):
                return False
        STEPS_OUT.inc()
        log.info(
            "step %d: %d micro-batch(es), %d loss tokens", batches[0].step, len(batches), batches[0].step_loss_tokens
        )
        return True

    def close(self) -> None:
        spool = getattr(self, "spool", None)
        if spool is not None:
            spool.close()
        eval_spool = getattr(self, "eval_spool", None)
        if eval_spool is not None:
            eval_spool.close()
        super().close()

    def run(self) -> None:
        for closed in self.eval_spool.closed_on_replay:  # complete before the restart, not yet published
            self._publish_eval(closed)
        self.eval_spool.closed_on_replay.clear()
        for step, groups in self.planned:  # steps planned before a restart, not yet released
            RESENT_STEPS.inc()
            log.info("sending step %d again (planned before the restart)", step)
            if not self._send_step(self.packer.pack(groups, step)):
                return
        while not self.stop.is_set():
            if self._run_done():
                return
            self._republish_eval()
            group = self.scored.recv(timeout_s=0.2)
            if group is not None:
                self._take_received(group)
            batches, dropped = self.packer.pop_step()
            self._announce_dropped(dropped, DropReason.STALE)
            BUFFERED.set(len(self.packer.buffer))
            UNFINISHED.set(self.batches.unfinished())
            if batches:
                self.spool.planned(batches[0].step, [g.id for g in self.packer.last_groups])  # durable before sent
                if not self._send_step(batches):
                    return  # stopped while blocked
                self.samples_log.write(batches[0].step, self.packer.last_groups)


if __name__ == "__main__":
    raise SystemExit(component_main(PackerProc))
