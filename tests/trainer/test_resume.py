"""Resuming the trainer: bit-exact training after a checkpoint load, the custody bookkeeping
(:class:`trainer.state.step_ledger.StepLedger`), the run records cut back to a checkpoint, and the trainer
process itself resuming against a real ``batches`` outbox, a real ``outcomes`` receiver (the
prompt source's ledger: every ``groups.trained`` recorded once, before ``run.done``) and a
control channel.

Exact resume: an uninterrupted run trains k + 2 steps with a checkpoint at step k; a FRESH model
and optimizer load that checkpoint and replay the same 2 steps with the same micro-batches:
float32 weights and AdamW state must be bit-identical. The LoRA case uses adapter dropout, so it
also fails unless the torch RNG state is restored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq
from safetensors.torch import load_file

from broadcaster.filesystem import FilesystemSender
from bus.courier import Courier
from bus.messages import EvalResult, GroupsTrained, MicroBatch, RunDone, TrainerStep, WeightsReady, new_id
from bus.registry import CONTROL_TYPES
from bus.sockets import BusSocket
from bus.topics import Endpoints
from configs.schema import RunConfig, dump_config
from lifecycle.launch_env import ENV_RESTARTS as RESTARTS_ENV
from lifecycle.launch_env import ENV_RESUME as RESUME_ENV
from packer.assemble import fill_micro_batch
from runfiles.jsonl import keep_jsonl_records
from tests.outcomes_sink import OutcomesSink
from tests.scored_groups import scored
from tests.trainer.test_checkpoint import CFG, assert_same_optimizer_state, policy, step_batches, weights
from tests.weight_peer import WeightPeer
from trainer.observability.step_keys import undocumented
from trainer.proc import TrainerProc, drop_weight_versions
from trainer.state.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from trainer.state.step_ledger import StepLedger, group_id
from trainer.trainer import Trainer

SAVE_AT = 2  # checkpoint after this many steps, then 2 more
WAIT_S = 120.0  # bound on waiting for a process event (a hang fails instead of blocking the suite)


# -- exact resume ------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_resume_is_bit_identical_to_the_uninterrupted_run(model_dir, tmp_path, lora):
    model = policy(model_dir, lora)
    batches = step_batches(model, SAVE_AT + 2)
    trainer = Trainer(model, CFG)
    torch.manual_seed(7)
    for mbs in batches[:SAVE_AT]:
        assert trainer.step(mbs)["skipped"] == 0.0
    path = save_checkpoint(
        tmp_path,
        step=SAVE_AT,
        model=model,
        optimizer=trainer.optimizer,
        extra={"policy_version": SAVE_AT, "weight_method": "filesystem"},
    )
    assert path == tmp_path / f"step_{SAVE_AT:06d}" and (path / "DONE").is_file()
    assert (path / ("adapter_model.safetensors" if lora else "model.safetensors")).is_file()
    saved = weights(model)
    for mbs in batches[SAVE_AT:]:
        trainer.step(mbs)
    reference, reference_opt = weights(model), trainer.optimizer.state_dict()
    assert any(not torch.equal(saved[n], reference[n]) for n in saved)

    def resume(reseed: int | None = None) -> Trainer:
        fresh = policy(model_dir, lora)
        resumed = Trainer(fresh, CFG)
        state = load_checkpoint(latest_checkpoint(tmp_path), model=fresh, optimizer=resumed.optimizer)
        assert state == {"step": SAVE_AT, "policy_version": SAVE_AT, "weight_method": "filesystem"}
        for n, t in weights(fresh).items():
            assert torch.equal(t, saved[n]), n
        if reseed is not None:
            torch.manual_seed(reseed)
        for mbs in batches[state["step"] :]:
            resumed.step(mbs)
        return resumed

    resumed = resume()
    after = weights(resumed.model)
    for n in reference:
        assert after[n].dtype == torch.float32
        assert torch.equal(after[n], reference[n]), n
    assert_same_optimizer_state(resumed.optimizer.state_dict(), reference_opt)
    if lora:  # adapter dropout draws from the torch RNG: without its restored state, no match
        other = weights(resume(reseed=123).model)
        assert any(not torch.equal(other[n], reference[n]) for n in reference)


# -- StepLedger ----------------------------------------------------------------------------------------


def mb(step: int, index: int, count: int, groups: list[str]) -> MicroBatch:
    """A micro-batch with one 2-token sample per group: sample ids ``{group}/{index}``."""
    return fill_micro_batch(
        [scored(g, [1], [[2]] * (index + 1), version=step) for g in groups],
        [(k, index) for k in range(len(groups))],
        teacher=False,
        step=step,
        micro_index=index,
        num_micro_batches=count,
        step_loss_tokens=len(groups) * count,
        step_samples=len(groups) * count,
    )


def test_ledger_buffers_steps_and_releases_only_what_a_checkpoint_covers():
    ledger = StepLedger()
    # step 1 arrives ahead of step 0, and step 0's parts out of order
    for m in (mb(1, 0, 1, ["c"]), mb(0, 1, 2, ["b", "a"]), mb(2, 1, 2, ["e"])):
        assert ledger.offer(m) == []
    assert ledger.take(0) is None and ledger.buffered_steps() == [0, 1, 2]
    assert ledger.offer(mb(0, 0, 2, ["a", "d"])) == []
    step0 = ledger.take(0)
    assert [m.id for m in step0] == ["0:0", "0:1"] and ledger.next_step == 1
    assert [m.id for m in ledger.take(1)] == ["1:0"]
    assert ledger.take(2) is None  # half of step 2 is here
    # a checkpoint after 1 step covers step 0 only; step 1 stays held
    (c0,) = ledger.cover(1)
    assert (c0.step, c0.message_ids, c0.group_ids) == (0, ["0:0", "0:1"], ["a", "d", "b"])
    assert ledger.cover(1) == []  # nothing twice
    (c1,) = ledger.cover(2)
    assert (c1.step, c1.message_ids, c1.group_ids) == (1, ["1:0"], ["c"])
    assert ledger.covered == 2 and ledger.buffered_steps() == [2]


def test_ledger_reports_a_step_complete_only_with_all_its_micro_batches():
    ledger = StepLedger()
    assert not ledger.is_complete(1)
    ledger.offer(mb(1, 1, 2, ["a"]))
    assert not ledger.is_complete(1)
    ledger.offer(mb(1, 0, 2, ["b"]))
    assert ledger.is_complete(1) and not ledger.is_complete(0)
    ledger.offer(mb(0, 0, 1, ["c"]))
    ledger.take(0)
    assert ledger.is_complete(1)
    ledger.take(1)
    assert not ledger.is_complete(1)  # taken: no longer waiting


def test_ledger_covers_several_steps_at_once_and_counts_repeats_once():
    ledger = StepLedger()
    for step in range(3):
        ledger.offer(mb(step, 0, 1, [f"g{step}"]))
        assert ledger.take(step) is not None
    assert ledger.offer(mb(1, 0, 1, ["g1"])) == []  # re-sent after training, before the checkpoint
    covered = ledger.cover(3)
    assert [(c.step, c.message_ids, c.group_ids) for c in covered] == [
        (0, ["0:0"], ["g0"]),
        (1, ["1:0"], ["g1"]),
        (2, ["2:0"], ["g2"]),
    ]


def test_ledger_after_resume_releases_covered_steps_at_once():
    ledger = StepLedger(start_step=3)
    assert ledger.offer(mb(1, 0, 2, ["old"])) == ["1:0"]  # the packer re-sends an unreleased step
    assert ledger.offer(mb(2, 1, 2, ["old"])) == ["2:1"]
    assert ledger.offer(mb(3, 0, 1, ["new"])) == []
    assert ledger.cover(3) == []  # nothing trained yet
    assert [m.id for m in ledger.take(3)] == ["3:0"]
    assert [c.group_ids for c in ledger.cover(4)] == [["new"]]


def test_ledger_refuses_inconsistent_use():
    ledger = StepLedger()
    ledger.offer(mb(0, 0, 2, ["a"]))
    with pytest.raises(ValueError, match="says 3 micro-batches, earlier ones of that step said 2"):
        ledger.offer(mb(0, 1, 3, ["a"]))
    with pytest.raises(ValueError, match="steps train in order"):
        ledger.take(1)
    with pytest.raises(ValueError, match="cannot cover 1 steps"):
        ledger.cover(1)
    with pytest.raises(ValueError):
        StepLedger(start_step=-1)


def test_group_id_is_everything_before_the_last_slash():
    assert group_id("abc/3") == "abc" and group_id("run/7/12") == "run/7" and group_id("solo") == "solo"


# -- run records ---------------------------------------------------------------------------------------


def test_keep_jsonl_records_cuts_back_atomically(tmp_path):
    path = tmp_path / "m.jsonl"
    assert keep_jsonl_records(path, lambda r: True) == 0 and not path.exists()
    lines = [json.dumps({"step": s}) for s in range(5)]
    path.write_text("\n".join(lines) + '\n{"step": 5, "tor')  # a kill in the middle of an append
    assert keep_jsonl_records(path, lambda r: r["step"] < 3) == 3
    assert path.read_text() == "\n".join(lines[:3]) + "\n"
    assert keep_jsonl_records(path, lambda r: True) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl"]
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match="m.jsonl:2 is not JSON"):
        keep_jsonl_records(path, lambda r: True)


def test_drop_weight_versions(tmp_path):
    for name in ("v1", "v2", "v3", "v10", "vx", "other"):
        (tmp_path / name).mkdir()
    assert sorted(p.name for p in drop_weight_versions(tmp_path, 3)) == ["v10", "v3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "v1", "v2", "vx"]
    assert drop_weight_versions(tmp_path / "missing", 0) == []


# -- the trainer process against a real outbox, outcomes receiver and control channel --------------------


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    """rlbus's tiny Qwen3 policy with its byte tokenizer (random weights): loads like the real one."""
    from policies.tiny_model import build_random_policy

    return str(build_random_policy(tmp_path_factory.mktemp("policy"), hidden_size=32, num_layers=1, seed=0))


@pytest.fixture(scope="module")
def batches(tiny_policy) -> list[list[MicroBatch]]:
    """Four steps of micro-batches, with sample ids unique per step (groups ``s{step}g{k}``)."""
    model = policy(tiny_policy, lora=False)
    return [
        [dataclasses.replace(m, sample_ids=[f"s{step}{s}" for s in m.sample_ids]) for m in mbs]
        for step, mbs in enumerate(step_batches(model, 4))
    ]


def run_config(run_dir: Path, policy_dir: str, eval: dict | None = None, **trainer) -> RunConfig:
    """A 4-step run with a cosine learning-rate schedule (a different rate every step, so a
    resume that lost the schedule's place gives other weights); online eval off unless ``eval``
    says otherwise (no producers here)."""
    run_dir.mkdir(exist_ok=True)  # busctl makes it (and writes config.yaml there)
    return RunConfig.model_validate(
        {
            "run_dir": str(run_dir),
            "model": {"path": policy_dir},
            "eval": eval or {"enabled": False},
            "sampling": {"max_tokens": 4},
            "trainer": {
                "max_steps": 4,
                "checkpoint_interval": 2,
                "num_threads": 1,
                "optim": {"scheduler": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1},
                **trainer,
            },
            "packer": {"max_off_policy_steps": 8},
            "broadcast": {"method": "filesystem"},
            "bus": {"heartbeat_s": 0.1, "dead_after_s": 2.0, "ack_timeout_s": 2.0},
        }
    )


class Packer:
    """The trainer's peers: the packer's ``batches`` outbox (bound), the prompt source's ledger
    (an :class:`OutcomesSink` bound at ``outcomes``, releasing at once: no test waits for the
    trainer's end-of-run drain), the hub's XSUB (bound), which collects everything the trainer
    announces on the control channel, the hub's XPUB (bound), on which the test publishes what
    the packer would (``eval.result``), and the supervisor's handshake socket (bound, so a
    trainer process finds it)."""

    def __init__(self, cfg: RunConfig) -> None:
        endpoints = Endpoints(cfg.bus.transport, Path(cfg.run_dir), cfg.bus.host, cfg.bus.base_port)
        endpoints.ensure_dirs()
        self.ctx = zmq.Context()
        self.stop = threading.Event()
        b = cfg.bus
        self.courier = Courier(
            self.ctx,
            heartbeat_s=b.heartbeat_s,
            dead_after_s=b.dead_after_s,
            ack_timeout_s=b.ack_timeout_s,
            stop=self.stop,
        )
        self.outbox = self.courier.sender("batches", endpoints.address("batches"), bind=True, capacity=64)
        self.ledger = OutcomesSink(self.courier, endpoints.address("outcomes"))
        self.control = BusSocket(
            self.ctx,
            "control_pub",
            "recv",
            endpoints.address("control_pub"),
            bind=True,
            stop=self.stop,
            accept=CONTROL_TYPES,
        )
        self.control.sock.send(b"\x01")  # XSUB: subscribe to everything, as the hub does
        self.publish = BusSocket(
            self.ctx, "control_sub", "send", endpoints.address("control_sub"), bind=True, stop=self.stop
        )
        self.supervisor = BusSocket(
            self.ctx, "supervisor", "recv", endpoints.address("supervisor"), bind=True, stop=self.stop
        )
        self.seen: list = []

    def send(self, micro_batches: list[MicroBatch]) -> None:
        for m in micro_batches:
            assert self.outbox.send(m, timeout_s=WAIT_S)

    def wait_for(self, what: str, predicate, trainer) -> None:
        """Collect control messages until ``predicate(self)`` holds; fail after WAIT_S, or at once
        when ``trainer.check()`` says the trainer failed."""
        deadline = time.monotonic() + WAIT_S
        while not predicate(self):
            trainer.check(what)
            assert time.monotonic() < deadline, (
                f"waited {WAIT_S} s for {what}; control messages: {[type(m).__name__ for m in self.seen]}"
            )
            msg = self.control.recv(timeout_s=0.1)
            if msg is not None:
                self.seen.append(msg)
            while self.supervisor.recv(timeout_s=0) is not None:  # handshakes and heartbeats
                pass

    def of_type(self, cls) -> list:
        return [m for m in self.seen if isinstance(m, cls)]

    def recorded(self) -> list[tuple[str, int, list[str]]]:
        """(id, step, sorted group ids) of every ``groups.trained`` the ledger recorded, in order."""
        return [(m.id, m.step, sorted(m.group_ids)) for m in self.ledger.received(GroupsTrained)]

    def close(self) -> None:
        self.stop.set()
        self.ledger.close()
        self.courier.close()
        self.control.close()
        self.publish.close()
        self.supervisor.close()
        self.ctx.term()


class RunningTrainer:
    """A :class:`TrainerProc` set up in this process, its ``run()`` on a thread."""

    def __init__(self, cfg: RunConfig) -> None:
        self.proc = TrainerProc(cfg, "trainer", 0)
        self.error: BaseException | None = None
        try:
            self.proc.setup()
        except BaseException:
            self.proc.close()
            raise
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.proc.run()
        except BaseException as exc:  # re-raised in the test by check() or stop()
            self.error = exc

    def check(self, what: str) -> None:
        if self.error is not None:
            raise AssertionError(f"the trainer failed while waiting for {what}") from self.error

    def stop(self) -> None:
        """Stop it as SIGTERM does; closing says goodbye, so the packer re-sends what it held."""
        self.proc.stop.set()
        self.thread.join(timeout=WAIT_S)
        assert not self.thread.is_alive(), "the trainer did not stop"
        self.proc.close()
        self.check("its stop")


class TrainerProcess:
    """``python -m trainer.proc`` as busctl starts it (stderr to ``log``)."""

    def __init__(self, run_dir: Path, log: Path, **env: str) -> None:
        self.log = log
        with log.open("ab") as err:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "trainer.proc", "--run-dir", str(run_dir), "--name", "trainer"],
                cwd=Path(__file__).resolve().parents[2],
                stdout=err,
                stderr=err,
                env={**os.environ, **env},
            )

    def check(self, what: str) -> None:
        code = self.popen.poll()
        if code is not None:
            raise AssertionError(
                f"the trainer exited ({code}) while waiting for {what}:\n{self.log.read_text()[-3000:]}"
            )

    def kill(self, sig: int) -> None:
        self.popen.send_signal(sig)
        self.popen.wait(timeout=WAIT_S)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(latest_checkpoint(run_dir / "checkpoints") / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tiny_policy, batches, tmp_path_factory) -> Path:
    """The run directory of one uninterrupted 4-step run (checkpoints at 2 and 4)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(RESTARTS_ENV, raising=False)
        mp.delenv(RESUME_ENV, raising=False)
        cfg = run_config(tmp_path_factory.mktemp("reference"), tiny_policy)
        packer = Packer(cfg)
        try:
            trainer = RunningTrainer(cfg)
            for mbs in batches:
                packer.send(mbs)
            packer.wait_for("run.done", lambda p: p.of_type(RunDone), trainer)
            # run.done comes only once the ledger has recorded (done) every step's outcome
            assert [r[:2] for r in packer.recorded()] == [(f"trained-step-{s}", s) for s in range(4)]
            assert trainer.proc.outcomes.unfinished() == 0
            packer.wait_for("every step released", lambda p: p.outbox.unfinished() == 0, trainer)
            trainer.stop()
        finally:
            packer.close()
    announced = [(m.id, m.step) for m in packer.of_type(GroupsTrained)]
    assert announced == [(f"trained-step-{s}", s) for s in range(4)]
    return Path(cfg.run_dir)


def assert_same_outcome(run_dir: Path, reference: Path) -> None:
    """The surviving lineage's records are those of the uninterrupted run (every step once), and
    its final weights are bit-identical."""
    assert read_jsonl(run_dir / "trained_samples.jsonl") == read_jsonl(reference / "trained_samples.jsonl")
    assert [r["step"] for r in read_jsonl(run_dir / "trained_samples.jsonl")] == [0, 1, 2, 3]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert [undocumented(r) for r in metrics] == [[]] * 4  # the process's keys have rows too (STEP_KEYS)
    lrs = [r["lr"] for r in metrics]  # the schedule resumed at its place (scheduler.pt)
    assert lrs == [r["lr"] for r in read_jsonl(reference / "metrics.jsonl")] and len(set(lrs)) == 4
    resumed, expected = final_weights(run_dir), final_weights(reference)
    assert resumed.keys() == expected.keys()
    for name in expected:
        assert torch.equal(resumed[name], expected[name]), name


def test_trainer_releases_at_checkpoints_and_resumes_after_a_restart(
    tiny_policy, batches, reference, tmp_path, monkeypatch
):
    monkeypatch.delenv(RESTARTS_ENV, raising=False)
    monkeypatch.delenv(RESUME_ENV, raising=False)
    per_step = [len(mbs) for mbs in batches]
    groups = [sorted({group_id(s) for m in mbs for s in m.sample_ids}) for mbs in batches]
    cfg = run_config(tmp_path, tiny_policy)
    packer = Packer(cfg)
    try:
        trainer = RunningTrainer(cfg)
        for mbs in batches[:3]:
            packer.send(mbs)
        packer.wait_for("trainer.step 3", lambda p: any(m.step == 3 for m in p.of_type(TrainerStep)), trainer)
        # steps 0 and 1 are covered by the checkpoint at 2 and released; step 2 is trained but held
        assert [(m.id, m.step, sorted(m.group_ids)) for m in packer.of_type(GroupsTrained)] == [
            ("trained-step-0", 0, groups[0]),
            ("trained-step-1", 1, groups[1]),
        ]
        # the same outcomes reach the prompt source's ledger on the reliable topic
        packer.ledger.wait_for(lambda s: len(s.received()) >= 2, "the outcomes of steps 0 and 1")
        assert packer.recorded() == [("trained-step-0", 0, groups[0]), ("trained-step-1", 1, groups[1])]
        packer.wait_for("steps 0 and 1 released", lambda p: p.outbox.unfinished() <= per_step[2], trainer)
        assert packer.outbox.unfinished() == per_step[2]
        assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_000002"]
        trainer.stop()
        assert packer.outbox.unfinished() == per_step[2]

        packer.seen.clear()
        monkeypatch.setenv(RESTARTS_ENV, "1")
        trainer = RunningTrainer(cfg)
        assert trainer.proc.start_step == 2 and isinstance(trainer.proc.publisher.sender, FilesystemSender)
        # the first weights.ready of version 2 (a re-announcement of the stopped trainer's latest,
        # version 3, may still arrive: bus.control.ControlPublisher; receivers drop the lost lineage)
        packer.wait_for("weights of version 2", lambda p: any(m.version == 2 for m in p.of_type(WeightsReady)), trainer)
        ready = next(m for m in packer.of_type(WeightsReady) if m.version == 2)
        assert (ready.version, ready.method) == (2, "filesystem")
        published = load_file(Path(ready.path) / "model.safetensors")
        saved = load_file(tmp_path / "checkpoints" / "step_000002" / "model.safetensors")
        assert all(torch.equal(published[n], saved[n]) for n in saved)
        packer.ledger.hold()  # from now on the ledger is slow to record (and release) outcomes
        packer.send([batches[0][0]])  # a covered step again: released at once, not trained
        packer.send(batches[3])
        # steps 2 and 3 trained, checkpointed, reported: the trainer waits for the ledger to
        # record its outcomes before it ends the run
        packer.ledger.wait_for(lambda s: len(s.received()) == 4, "the outcomes of steps 2 and 3")
        packer.wait_for("trainer.step 4", lambda p: any(m.step == 4 for m in p.of_type(TrainerStep)), trainer)
        until = time.monotonic() + 0.3
        packer.wait_for("0.3 s more of control messages", lambda p: time.monotonic() > until, trainer)
        assert not packer.of_type(RunDone), "run.done before the ledger recorded the trained outcomes"
        assert trainer.proc.outcomes.unfinished() == 2
        assert packer.ledger.release() == ["trained-step-2", "trained-step-3"]
        packer.wait_for("run.done", lambda p: p.of_type(RunDone), trainer)
        # recorded before run.done, each step once: the re-announced steps 0 and 1 carry the same
        # ids, and the ledger's inbox drops them as duplicates
        assert packer.recorded() == [(f"trained-step-{s}", s, groups[s]) for s in range(4)]
        assert trainer.proc.outcomes.unfinished() == 0
        packer.wait_for("every micro-batch released", lambda p: p.outbox.unfinished() == 0, trainer)
        trainer.stop()
    finally:
        packer.close()
    # on the control channel: steps 0 and 1 again (a trainer may die between a save and those
    # announcements; same ids), then 2 and 3 with the final checkpoint
    assert [(m.id, m.step) for m in packer.of_type(GroupsTrained)] == [(f"trained-step-{s}", s) for s in range(4)]
    # trainer.step is a latest-value announcement: bus.control.ControlPublisher may re-send the
    # latest one after (re)connecting, so compare the distinct steps in order of first appearance
    assert list(dict.fromkeys(m.step for m in packer.of_type(TrainerStep))) == [3, 4]
    assert_same_outcome(tmp_path, reference)


def test_the_trainer_waits_for_the_final_eval_round_then_ends_without_the_missing_task(
    tiny_policy, batches, tmp_path, monkeypatch, caplog
):
    """After its last step the trainer waits up to ``eval.timeout_s`` for round ``max_steps`` of
    every eval task (the packer publishes them and writes eval.jsonl), warns about the missing one,
    then sends ``run.done``; its metrics.jsonl holds training records only."""
    monkeypatch.delenv(RESTARTS_ENV, raising=False)
    monkeypatch.delenv(RESUME_ENV, raising=False)
    timeout_s = 3.0
    tasks = [{"name": "reverse_text"}, {"name": "countdown", "rollouts_per_example": 4}]
    cfg = run_config(
        tmp_path, tiny_policy, eval={"enabled": True, "interval": 2, "tasks": tasks, "timeout_s": timeout_s}
    )
    final = EvalResult(
        id=new_id(),
        round=4,
        task="reverse_text",
        version_min=4,
        version_max=4,
        num_samples=8,
        num_failed=0,
        metrics={"reward_mean": 0.75},
    )
    packer = Packer(cfg)
    try:
        with caplog.at_level(logging.WARNING, logger="trainer.final_eval"):
            trainer = RunningTrainer(cfg)
            for mbs in batches:
                packer.send(mbs)
            packer.wait_for("trainer.step 4", lambda p: any(m.step == 4 for m in p.of_type(TrainerStep)), trainer)
            assert not packer.of_type(RunDone), "run.done before the final eval round"
            started = time.monotonic()

            def final_published(p: Packer) -> bool:  # countdown's result never comes
                p.publish.send(final)  # repeated: the trainer keeps one per (round, task)
                return bool(p.of_type(RunDone))

            packer.wait_for("run.done", final_published, trainer)
            assert time.monotonic() - started > 0.5  # it waited for countdown's result
            trainer.stop()
    finally:
        packer.close()
    assert "round 4 for task(s) countdown after" in caplog.text  # reverse_text's came
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


def test_a_killed_trainer_process_resumes_from_its_checkpoint(tiny_policy, batches, reference, tmp_path):
    """SIGKILL (no goodbye): the packer's outbox finds the trainer dead by its silence and re-sends
    the unreleased step to the restarted process."""
    cfg = run_config(tmp_path, tiny_policy)
    (tmp_path / "config.yaml").write_text(dump_config(cfg))
    packer = Packer(cfg)
    trainer = None
    try:
        trainer = TrainerProcess(tmp_path, tmp_path / "trainer.log")
        for mbs in batches[:3]:
            packer.send(mbs)
        packer.wait_for("trainer.step 3", lambda p: any(m.step == 3 for m in p.of_type(TrainerStep)), trainer)
        trainer.kill(signal.SIGKILL)
        held = packer.outbox.unfinished()
        assert held >= len(batches[2])  # step 2 at least: trained after the checkpoint at 2
        trainer = TrainerProcess(tmp_path, tmp_path / "trainer.log", **{RESTARTS_ENV: "1"})
        packer.send(batches[3])
        packer.wait_for("run.done", lambda p: p.of_type(RunDone), trainer)
        # every step's outcome recorded once before run.done, whichever trainer's report arrived
        assert [r[:2] for r in packer.recorded()] == [(f"trained-step-{s}", s) for s in range(4)]
        packer.wait_for("every micro-batch released", lambda p: p.outbox.unfinished() == 0, trainer)
        trainer.kill(signal.SIGTERM)
        assert trainer.popen.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        if trainer is not None and trainer.popen.poll() is None:
            trainer.kill(signal.SIGKILL)
        packer.close()
    assert "resumed from" in (tmp_path / "trainer.log").read_text()
    assert_same_outcome(tmp_path, reference)


def test_a_trainer_that_released_steps_without_checkpoints_refuses_to_restart(tiny_policy, tmp_path, monkeypatch):
    cfg = run_config(tmp_path, tiny_policy, checkpoint_interval=0)
    (tmp_path / "trained_samples.jsonl").write_text(
        json.dumps({"step": 0, "sample_ids": ["g/0"], "versions": [0]}) + "\n"
    )
    monkeypatch.setenv(RESTARTS_ENV, "1")
    proc = TrainerProc(cfg, "trainer", 0)
    try:
        with pytest.raises(ValueError, match="checkpoint_interval 0 those steps were released"):
            proc.setup()
    finally:
        proc.close()


def test_a_failed_broadcast_switches_the_trainer_to_the_filesystem_method(tiny_policy, batches, tmp_path, monkeypatch):
    """A real gloo weight group whose only producer leaves after receiving version 1: the
    broadcast of version 2 raises, the trainer tries to re-form the group (the producer is gone:
    it never acknowledges, the attempt times out and counts as failed), moves that producer to the
    filesystem method, sends version 2 again there, and keeps the filesystem method (also in its
    checkpoints)."""
    pytest.importorskip("vllm", reason="the stateless group helper comes from vLLM")
    from prometheus_client import REGISTRY

    from broadcaster.manifest import build_manifest
    from trainer.state.model import load_policy, policy_state_dict

    monkeypatch.delenv(RESTARTS_ENV, raising=False)
    monkeypatch.delenv(RESUME_ENV, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = run_config(tmp_path, tiny_policy)
    cfg.broadcast = cfg.broadcast.model_copy(
        update={"method": "broadcast", "backend": "gloo", "port": port, "timeout_s": 20.0, "reform_timeout_s": 5.0}
    )
    manifest = build_manifest(policy_state_dict(load_policy(tiny_policy, cfg.trainer.lora)))

    def failed_reforms() -> float:
        return REGISTRY.get_sample_value("rlbus_trainer_weight_group_reforms_total", {"outcome": "failed"}) or 0.0

    failed_before = failed_reforms()
    # receives version 1 (through the worker extension's BucketReceiver), then dies
    producer = WeightPeer(port, manifest, versions=1)
    packer = Packer(cfg)
    try:
        trainer = RunningTrainer(cfg)  # forms the group with the producer
        for mbs in batches:
            packer.send(mbs)
        packer.wait_for("run.done", lambda p: p.of_type(RunDone), trainer)
        assert [r[:2] for r in packer.recorded()] == [(f"trained-step-{s}", s) for s in range(4)]
        trainer.stop()
        assert len(producer.result(WAIT_S)) == 1
    finally:
        packer.close()
        producer.kill()
    # distinct announcements in order (bus.control.ControlPublisher may repeat the latest one)
    assert list(dict.fromkeys((m.version, m.method) for m in packer.of_type(WeightsReady))) == [
        (1, "broadcast"),
        (2, "broadcast"),
        (2, "filesystem"),
        (3, "filesystem"),
        (4, "filesystem"),
    ]
    assert failed_reforms() == failed_before + 1  # the dead member never joined the new group
    assert REGISTRY.get_sample_value("rlbus_trainer_weight_members", {"method": "filesystem"}) == 1
    assert REGISTRY.get_sample_value("rlbus_trainer_weight_members", {"method": "broadcast"}) == 0
    meta = json.loads((latest_checkpoint(tmp_path / "checkpoints") / "meta.json").read_text())
    assert meta["extra"]["weight_method"] == "filesystem"
