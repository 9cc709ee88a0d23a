"""The trainer process (rank 0): ``batches`` -> optimizer step -> weights to the producers, with
checkpoints, custody of the micro-batches and resume after a restart (order, custody and resume
rules: docs/ARCHITECTURE.md, "The trainer process"). Under torchrun (``trainer.data_parallel > 1``)
this is rank 0; ranks > 0 run :mod:`trainer.dp_follower`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from prometheus_client import Counter

from broadcaster.bus_method import BusLink
from broadcaster.factory import build_group_former, build_senders
from bus.component import Component, component_main, exit_now
from bus.messages import GroupsTrained, MicroBatch, RunDone, RunFinalStep, TrainerStep, new_id
from bus.sockets import BusSocket
from runfiles.jsonl import append_jsonl, keep_jsonl_records
from telemetry.metrics import POLICY_VERSION, StageMeter
from trainer.dp_follower import checkpoint_writer, follower_main, join_data_parallel, load_trainer_checkpoint
from trainer.final_eval import final_round_tasks, wait_for_round
from trainer.observability.step_log import report_step
from trainer.observability.step_timing import StepPhases
from trainer.parallel.device import trainer_device
from trainer.parallel.distributed import launcher_pid
from trainer.parallel.threads import ThreadPlan
from trainer.publish import WeightPublisher
from trainer.state.background_save import BackgroundSave
from trainer.state.checkpoint import latest_checkpoint, save_checkpoint, snapshot_state
from trainer.state.model import load_policy
from trainer.state.step_ledger import StepLedger, group_id
from trainer.trainer import build_trainer

log = logging.getLogger(__name__)

RECV_SLICE_S = 0.5
"""Longest wait for one micro-batch before checking the stop request again, seconds."""

RELEASED_MICRO_BATCHES = Counter(
    "rlbus_trainer_released_micro_batches_total",
    "Micro-batches released to the packer (done), by why: covered by a checkpoint after training, "
    "or re-sent for a covered step",
    ["why"],
)
for _why in ("checkpoint", "already_covered"):
    RELEASED_MICRO_BATCHES.labels(why=_why)


OUTCOMES_DRAIN_S = 60.0
"""How long the trainer waits at the end for the prompt source to record its outcomes, seconds."""


def trained_message_id(step: int) -> str:
    """Message id of step ``step``'s ``groups.trained``: the same in every announcement of the
    step (also after a resume), so receivers can drop repeats by id."""
    return f"trained-step-{step}"


def drop_weight_versions(out_dir: Path, first: int) -> list[Path]:
    """Delete the filesystem weight directories ``out_dir/v{N}`` with ``N >= first`` (a lost
    lineage); returns them."""
    gone = []
    for p in sorted(out_dir.glob("v*")) if out_dir.is_dir() else []:
        if p.is_dir() and p.name[1:].isdigit() and int(p.name[1:]) >= first:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


class TrainerProc(Component):
    """The trainer component: :class:`Trainer` with the weight publisher, checkpoints and custody;
    its ``run.done`` after the last step ends the run."""

    def setup(self) -> None:
        cfg = self.cfg
        if cfg.trainer.num_threads:
            torch.set_num_threads(cfg.trainer.num_threads)
        threads = cfg.trainer.num_threads or torch.get_num_threads()
        self.threads = ThreadPlan(
            threads, cfg.trainer.idle_threads or threads, cfg.max_async_level, cfg.trainer.max_steps
        )
        """Thread count per micro-batch: more once the producers have nothing left to sample."""
        torch.manual_seed(cfg.trainer.seed)
        # open first: by the time anything is announced, the PUB has long joined the hub
        self.control = self.control_publisher()
        self.final_step = cfg.trainer.max_steps
        """The step the run ends after: ``trainer.max_steps``, lower after ``busctl down --finish``."""
        self.finish_in = self.control_subscriber()  # run.final_step (a restart gets it from the hub's cache)
        self.outcomes = self.open_outcomes()
        self.dp = join_data_parallel(cfg)
        """This rank 0's data-parallel group (``trainer.data_parallel > 1``), else None."""
        self.model = load_policy(cfg.model.path, cfg.trainer.lora).to(trainer_device(cfg, self.dp))
        self.trainer = build_trainer(self.model, cfg)
        self.meter = StageMeter("trainer")
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "trained_samples.jsonl"
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.weights_dir = self.run_dir / "weights"
        self.resumed = False
        """True after a restart or with a checkpoint: the weight group is formed anew (trainer.publish)."""
        self.start_step = 0
        self.reannounce_from = 0
        """Steps ``[reannounce_from, start_step)`` get their ``groups.trained`` announced again."""
        self.restored_from: Path | None = None
        """The checkpoint this trainer resumed from (every data-parallel rank loads it too)."""
        fsdp = self.dp is not None and cfg.trainer.parallel == "fsdp"
        if fsdp:  # shard first, name the checkpoint: restore() loads into the shards with every rank
            self.trainer.enable_data_parallel(self.dp)
            self.dp.send_text(str(latest_checkpoint(self.checkpoint_dir) or ""))
        self.restore()
        self.final_eval: BusSocket | None = None
        """The control subscriber of the wait for the final eval round (trainer.final_eval)."""
        if self.dp is not None and not fsdp:  # every rank from the same checkpoint, then DDP
            self.dp.send_text(str(self.restored_from or ""))
            self.trainer.enable_data_parallel(self.dp)
        self.ledger = StepLedger(self.start_step)
        if self.threads.idle != self.threads.sampling:
            self.trainer.before_micro_batch = self.before_micro_batch
        self.saving = BackgroundSave()
        """The periodic checkpoint being written in the background (at most one)."""
        self.batches = self.reliable_receiver(
            "batches", self.endpoints.address("batches"), bind=False, accept=(MicroBatch,)
        )
        sender, fallback = build_senders(
            cfg.broadcast,
            world_size=1 + cfg.producers.replicas,
            out_dir=self.weights_dir,
            restarted=self.resumed,
            bus=BusLink(self.endpoints.address("weights"), self.ctx),
        )
        # weights.wanted / weights.group_ack reach the publisher on its own subscriber (trainer.publish)
        self.publisher = WeightPublisher.for_run(
            cfg,
            self.model,
            sender,
            fallback,
            self.control.send,
            self.dp,
            former=build_group_former(cfg.broadcast),
            rejoin=self.resumed,
            inbox=self.control_subscriber().recv,
        )
        sender.open()  # after: close() releases the sender even if the group never forms

    # -- resume -----------------------------------------------------------------------------------

    def restore(self) -> None:
        """Load the latest complete checkpoint, if any, cut the records back to it and set
        ``start_step``, ``reannounce_from`` and ``resumed``. ValueError for a checkpoint that does not
        fit the config, or a restart without one after released steps (``checkpoint_interval: 0``)."""
        restarts, resume = self.launch.restarts, self.launch.resume
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            if not (restarts or resume):
                return  # a fresh run
            trained = sum(1 for line in self.samples_path.open() if line.strip()) if self.samples_path.is_file() else 0
            if trained and self.cfg.trainer.checkpoint_interval == 0:
                raise ValueError(
                    f"the trainer restarted (restart {restarts}, resume {resume}) after {trained} trained steps with "
                    f"no checkpoint in {self.checkpoint_dir}: with trainer.checkpoint_interval 0 those steps were "
                    "released after training and cannot be re-sent; set trainer.checkpoint_interval > 0 to make "
                    "the trainer restartable"
                )
            log.warning(
                "restarted (restart %d, resume %s) with no checkpoint in %s: starting again at step 0",
                restarts,
                resume,
                self.checkpoint_dir,
            )
        else:
            state = load_trainer_checkpoint(path, self.trainer)
            self.restored_from = path
            step = state["step"]
            if step > self.cfg.trainer.max_steps:
                raise ValueError(f"{path} is at step {step}, beyond trainer.max_steps ({self.cfg.trainer.max_steps})")
            self.start_step = step
            # --resume: reports of earlier releases may have died in flight too (receivers dedupe by id)
            self.reannounce_from = 0 if resume else int(state.get("released_steps", 0))
            log.info(
                "resumed from %s at step %d (restart %d, resume %s; weights sent with %s before)",
                path,
                step,
                restarts,
                resume,
                state.get("weight_method", "?"),
            )
        self.resumed = True
        n = self.start_step
        # training records are {"step": s + 1}; the packer keeps the eval records (eval.jsonl)
        cut = keep_jsonl_records(self.metrics_path, lambda r: r["step"] <= n)
        cut += keep_jsonl_records(self.samples_path, lambda r: r["step"] < n)
        if cut:
            log.info(
                "dropped %d records of steps after the checkpoint from metrics.jsonl and trained_samples.jsonl", cut
            )

    def announce_resume(self) -> None:
        """Publish the restored weights as version ``start_step`` and re-announce the groups of
        the steps released with the checkpoint."""
        step = self.start_step
        gone = drop_weight_versions(self.weights_dir, step)
        if gone:
            log.info("deleted %d weight versions of the lost lineage (v%d and newer)", len(gone), step)
        self.publisher.publish(step)
        POLICY_VERSION.set(step)
        if self.reannounce_from < step and self.samples_path.is_file():
            for record in map(json.loads, self.samples_path.read_text().splitlines()):
                if self.reannounce_from <= record["step"] < step:
                    groups = list(dict.fromkeys(group_id(s) for s in record["sample_ids"]))
                    self.announce_trained(record["step"], groups)

    # -- per step ---------------------------------------------------------------------------------

    def receive_step(self, step: int) -> list[MicroBatch] | None:
        """Collect step ``step``'s micro-batches (buffering other steps' in the ledger, releasing
        re-sent ones of covered steps); None if stopped first, [] once the run ends before ``step``."""
        while (micro_batches := self.ledger.take(step)) is None:
            if self.stop.is_set():
                return None
            self.poll_final_step()
            if step >= self.final_step:
                return []
            self.publisher.poll()  # a failed background send falls back NOW: a restarted producer waits for it
            self.settle_saves(wait=False)  # a background checkpoint done: release its steps now
            self.take_in(self.batches.recv(timeout_s=RECV_SLICE_S))
        return micro_batches

    def poll_final_step(self) -> None:
        """Take in the prompt source's ``run.final_step`` (``busctl down --finish``)."""
        while (msg := self.finish_in.recv(timeout_s=0)) is not None:
            if isinstance(msg, RunFinalStep) and msg.step < self.final_step:
                self.final_step = msg.step
                log.info("finishing early: the run ends after step %d", msg.step)
                self.open_final_eval()  # before round final_step's weights go out, if not yet

    def take_in(self, mb: MicroBatch | None) -> None:
        """Offer a received micro-batch (None: nothing) to the ledger; release a re-sent one of a
        covered step."""
        release = self.ledger.offer(mb) if mb is not None else None
        if release:
            self.batches.done(*release)
            RELEASED_MICRO_BATCHES.labels(why="already_covered").inc(len(release))

    def before_micro_batch(self) -> None:
        """Between micro-batches: take in what arrived meanwhile, then pick the thread count
        (:mod:`trainer.parallel.threads`) from which steps ahead are complete."""
        while (mb := self.batches.recv(timeout_s=0)) is not None:
            self.take_in(mb)
        self.threads.apply(self.ledger.next_step - 1, self.ledger.is_complete)

    def save(self, step: int, *, background: bool = False) -> None:
        """Checkpoint after ``step`` optimizer steps, with the policy version, weight method, LR
        schedule and ``released_steps`` a resumed trainer needs; ``background``: copy the state now,
        write it on :attr:`saving`'s thread (released by :meth:`settle_saves`)."""
        model, optimizer, scheduler = self.model, self.trainer.optimizer, self.trainer.scheduler
        extra = {
            "policy_version": step,
            "weight_method": self.publisher.method,
            "lr_schedule": self.cfg.trainer.optim.scheduler,
            "released_steps": self.ledger.covered,
        }
        sharded = checkpoint_writer(self.trainer)  # fsdp: every rank writes its shards, now (no thread: collectives)
        release_now, background = background and sharded is not None, background and sharded is None
        state = snapshot_state(model, optimizer, scheduler) if background else None

        def write() -> Path:
            return save_checkpoint(
                self.checkpoint_dir,
                step=step,
                model=model,
                optimizer=optimizer,
                extra=extra,
                keep=self.cfg.trainer.checkpoint_keep,
                scheduler=scheduler,
                state=state,
                write_state=sharded,
            )

        if background:
            self.saving.start(step, write)
        else:
            log.info("checkpoint of step %d in %s", step, write())
            if release_now:
                self.release(step)

    def settle_saves(self, *, wait: bool) -> None:
        """Release the background checkpoint's steps once it is complete (``wait``: block until it
        is). Re-raises a failed save's exception."""
        done = self.saving.wait() if wait else self.saving.finished()
        if done is not None:
            step, path = done
            log.info("checkpoint of step %d in %s", step, path)
            self.release(step)

    def release(self, num_steps: int) -> None:
        """Steps below ``num_steps`` are durable: release their micro-batches and announce their
        groups as trained, one ``groups.trained`` per step."""
        for covered in self.ledger.cover(num_steps):
            self.batches.done(*covered.message_ids)
            RELEASED_MICRO_BATCHES.labels(why="checkpoint").inc(len(covered.message_ids))
            self.announce_trained(covered.step, covered.group_ids)

    def announce_trained(self, step: int, group_ids: list[str]) -> None:
        """Outcome ``trained`` for ``group_ids``: to the prompt source's ledger (reliable; blocks
        while its outbox is full) and on the control channel."""
        msg = GroupsTrained(id=trained_message_id(step), step=step, group_ids=group_ids)
        self.outcomes.send(msg)
        self.control.send(msg)

    def commit(self, step: int) -> None:
        """After ``step`` optimizer steps: release what the previous checkpoint made durable,
        checkpoint if due (the last one now, periodic ones in the background), release."""
        self.settle_saves(wait=True)  # normally written long ago, during this step
        interval = self.cfg.trainer.checkpoint_interval
        if step == self.final_step:
            self.save(step)
            self.release(step)
        elif interval and step % interval == 0:
            self.save(step, background=True)
        elif interval == 0:  # no periodic checkpoints: release at once (not restartable)
            self.release(step)

    def run(self) -> None:
        step = self.start_step
        if self.resumed:
            self.announce_resume()
        phases = StepPhases()  # where each step's wall time goes (trainer.observability.step_timing)
        self.poll_final_step()
        while step < self.final_step:
            if step == self.final_step - 1:
                self.open_final_eval()
            phases.wait_started()
            micro_batches = self.receive_step(step)
            phases.wait_ended()
            if micro_batches is None:
                log.info("stopped before step %d", step)
                return
            if not micro_batches:  # busctl down --finish: the run ends before this step
                break
            with self.meter.work():  # busy: forward, backward, optimizer step, weight hand-off
                share = self.dp.send_step(micro_batches) if self.dp is not None else micro_batches
                metrics = self.trainer.step(share)
                metrics["idle_thread_micro_batches"] = float(self.threads.take_idle_count())
                versions = np.concatenate([mb.oldest_versions for mb in micro_batches])
                lags = step - versions
                assert lags.max() <= self.cfg.packer.max_off_policy_steps, "the packer let a stale sample through"
                metrics["weight_sync_s"] = self.publisher.publish(step + 1)
            self.meter.finished(
                sum(len(mb.sample_ids) for mb in micro_batches), sum(int(mb.loss_mask.sum()) for mb in micro_batches)
            )
            step_s, times = phases.finish(metrics, metrics["weight_sync_s"])
            metrics.update(
                policy_lag_mean=float(lags.mean()),
                policy_lag_max=float(lags.max()),
                step_time_s=step_s,
                tokens_per_s=metrics["num_tokens"] / max(step_s, 1e-9),
                **times,
            )
            step += 1
            # records first, checkpoint second: a resume cuts records back to its checkpoint
            report_step(step, self.final_step, metrics, self.metrics_path)  # Prometheus, metrics.jsonl, the log line
            append_jsonl(
                self.samples_path,
                {
                    "step": step - 1,
                    "sample_ids": [i for mb in micro_batches for i in mb.sample_ids],
                    "versions": versions.tolist(),
                },
            )
            self.commit(step)
            # the message also carries the recent share of each phase, for busctl status
            self.control.send(
                TrainerStep(id=new_id(), step=step, version=step, metrics={**metrics, **phases.recent_shares()})
            )
            self.poll_final_step()
        if self.dp is not None:
            self.dp.send_stop()  # the other ranks are done; rank 0 goes on (eval, outcomes, run.done)
        self.publisher.settle()  # the last version reaches the producers before run.done
        self.open_final_eval()
        if tasks := final_round_tasks(self.cfg):  # the final round's result before run.done ends the run
            wait_for_round(self.final_eval, step, tasks, self.cfg.eval.timeout_s, self.stop)
        deadline = time.monotonic() + OUTCOMES_DRAIN_S
        while self.outcomes.unfinished() and time.monotonic() < deadline and not self.stop.is_set():
            time.sleep(0.05)  # run.done only once the ledger has every trained outcome
        if self.outcomes.unfinished():
            log.warning(
                "%d trained outcome(s) not yet recorded by the prompt source at the end", self.outcomes.unfinished()
            )
        reason = "max_steps" if step == self.cfg.trainer.max_steps else "finished early (busctl down --finish)"
        self.control.send(RunDone(id=new_id(), step=step, reason=reason))
        log.info("done: %d steps", step)

    def open_final_eval(self) -> None:
        """Subscribe to the control channel for the final eval round's results (once), before the
        last step's weights go out: that round is sampled only after the producers applied them."""
        if self.final_eval is None and final_round_tasks(self.cfg):
            self.final_eval = self.control_subscriber()

    def close(self) -> None:
        saving = getattr(self, "saving", None)
        if saving is not None:  # finish writing it (complete on disk; its steps stay unreleased)
            try:
                saving.wait()
            except Exception:
                log.exception("the background checkpoint failed")
        publisher = getattr(self, "publisher", None)
        if publisher is not None:
            publisher.close()
        dp = getattr(self, "dp", None)
        if dp is not None:
            if getattr(self, "trainer", None) is not None:
                self.trainer.disable_data_parallel()  # before the group goes
            dp.close()
        super().close()

    # -- the supervisor knows torchrun's agent, not rank 0 -----------------------------------------

    def supervised_pid(self) -> int:
        """:func:`launcher_pid`: under torchrun the supervisor watches the agent, our parent."""
        return launcher_pid()


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer.proc``: rank 0 (or the only rank) is the :class:`TrainerProc`
    component; ranks > 0 under torchrun run :func:`follower_main`."""
    if int(os.environ.get("RANK", "0")) > 0:
        return follower_main(argv)
    return component_main(TrainerProc, argv)


if __name__ == "__main__":
    exit_now(main())  # no interpreter teardown (seconds); close() has saved what the trainer keeps
