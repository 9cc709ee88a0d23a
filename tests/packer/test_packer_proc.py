"""PackerProc on a real bus: reliable ``scored`` in, reliable ``batches`` out, drops reported on
the reliable ``outcomes`` topic and published on a real control hub. Reward workers, the trainer
and the prompt source's ledger (:class:`tests.outcomes_sink.OutcomesSink`) are real
:class:`bus.courier.Courier` peers.

Checked: custody is released for every group: at once for a taken or duplicate group, for a
filtered one only once the ledger has recorded its drop; a group re-sent at any later time (by
another reward worker, after its step went out) never trains twice nor gets a second outcome;
micro-batches stay with the packer until the trainer marks them done, and a restarted trainer
gets them again; ``run.done`` ends the loop. Eval groups are never packed: the packer publishes
one ``eval.result`` per task once a round's groups (received + announced failed) are all in, and
only then releases them. A packer started again on the same run directory (a restart) sends the
steps it had planned again, identically, keeps its buffer and its seen ids (from its spool,
:mod:`packer.spool`); a resumed one without a spool numbers steps from the trainer's checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import zmq

import bus.inbox
from bus.courier import Courier
from bus.hub import ControlHub
from bus.inbox import Inbox
from bus.messages import EvalResult, GroupsDropped, GroupsTrained, Message, MicroBatch, RunDone, ScoredGroup, new_id
from bus.sockets import BusSocket
from bus.topics import Endpoints
from configs.schema import load_config
from packer.proc import PackerProc
from runfiles.eval_records import EVAL_FILE, eval_record
from tests import waiting
from tests.outcomes_sink import OutcomesSink
from tests.socket_dirs import remove_outside_socket_dir

TIMINGS = dict(heartbeat_s=0.05, dead_after_s=0.6, ack_timeout_s=3.0)
WAIT_S = 10.0
"""Longest any step of these tests waits for something that must happen, seconds."""


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = WAIT_S) -> Any:
    return waiting.wait_until(predicate, what, timeout_s)


def group(gid: str, rewards: list[float], version: int = 0) -> ScoredGroup:
    """Two samples of 7 tokens (prompt [1, 2], completions [10..14] and [20..24]); rewards as given.
    With a 16-token budget a step of two groups packs into two micro-batches."""
    return ScoredGroup(
        id=gid,
        prompt_index=0,
        step=0,
        task="reverse_text",
        info={"target": "x"},
        producer="producer-0",
        completion_texts=["a", "b"],
        finish_reasons=["stop", "stop"],
        gen_time_s=0.0,
        prompt_ids=np.int32([1, 2]),
        completion_ids=np.int32([*range(10, 15), *range(20, 25)]),
        completion_lens=np.int32([5, 5]),
        sampler_logprobs=np.full(10, -0.5, np.float32),
        version_start=np.int64([version] * 2),
        version_end=np.int64([version] * 2),
        reward_worker="rewards-0",
        rewards=np.float32(rewards),
        advantages=np.float32([r - np.mean(rewards) for r in rewards]),
    )


class LiveBus:
    """A run dir with a config, a control hub thread, a test publisher and observer on it, and
    couriers for the peers; everything closed at teardown."""

    def __init__(self, tmp_path, overrides: list[str]) -> None:
        bus = [f"bus.{k}={v}" for k, v in TIMINGS.items()]
        self.cfg = load_config(None, [f"run_dir={tmp_path}", *bus, *overrides])
        self.endpoints = Endpoints("ipc", tmp_path)
        self.endpoints.ensure_dirs()
        self.ctx = zmq.Context()
        self.stop = threading.Event()
        self.hub = ControlHub(
            self.ctx, self.endpoints.address("control_pub"), self.endpoints.address("control_sub"), self.stop
        )
        self.hub_thread = threading.Thread(target=self.hub.run, daemon=True)
        self.hub_thread.start()
        self.pub = BusSocket(self.ctx, "control_pub", "send", self.endpoints.address("control_pub"), bind=False)
        self.observer = BusSocket(self.ctx, "control_sub", "recv", self.endpoints.address("control_sub"), bind=False)
        self.couriers: list[Courier] = []
        self.sync(self.pub)

    def sync(self, pub: BusSocket) -> None:
        """Publish probes on ``pub`` until the observer gets one (no slow-joiner loss after this)."""
        for n in range(500):
            pub.send(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="sync"))
            if self.observer.recv(timeout_s=0.02) is not None:
                while self.observer.recv(timeout_s=0.05) is not None:
                    pass
                return
        pytest.fail("control hub not reachable")

    def announcements(self, quiet_s: float = 0.3) -> list[Message]:
        """Control messages seen since the last call (until ``quiet_s`` of silence), probes left out."""
        out = []
        while (msg := self.observer.recv(timeout_s=quiet_s)) is not None:
            if not (isinstance(msg, GroupsDropped) and msg.reason == "sync"):
                out.append(msg)
        return out

    def courier(self) -> Courier:
        """A courier on its own context: one simulated process."""
        self.couriers.append(Courier(zmq.Context(), **TIMINGS))
        return self.couriers[-1]

    def close_courier(self, courier: Courier) -> None:
        """Close one simulated process's courier (goodbye to its peers) and its context."""
        if courier in self.couriers:
            self.couriers.remove(courier)
            courier.stop.set()
            courier.close()
            courier.ctx.destroy(linger=0)

    def close(self) -> None:
        for c in list(self.couriers):
            self.close_courier(c)
        self.stop.set()
        self.hub_thread.join(timeout=5)
        for sock in (self.pub, self.observer, self.hub.inbound, self.hub.outbound):
            sock.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def live(tmp_path):
    # prompts_per_step = 4 / 2 = 2 groups; 16 tokens per micro-batch
    bus = LiveBus(
        tmp_path,
        [
            "trainer.batch_size=4",
            "producers.group_size=2",
            "packer.micro_batch_tokens=16",
            "packer.max_off_policy_steps=1",
            "max_async_level=1",
            "packer.filter_equal_rewards=true",
        ],
    )
    yield bus
    bus.close()
    remove_outside_socket_dir(tmp_path)


def start_packer(live: LiveBus) -> tuple[PackerProc, threading.Thread]:
    """A PackerProc on the live bus, its loop running in a thread."""
    proc = PackerProc(live.cfg, "packer", 0)
    proc.setup()
    live.sync(proc.control_out)  # its announcements reach the hub from now on (run() not started yet)
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    return proc, thread


def stop_packer(proc: PackerProc, thread: threading.Thread) -> None:
    proc.stop.set()
    thread.join(timeout=5)
    proc.close()


@pytest.fixture
def packer(live):
    proc, thread = start_packer(live)
    yield proc, thread
    stop_packer(proc, thread)


def receive_step(inbox: Inbox, step: int) -> list[MicroBatch]:
    """All micro-batches of ``step`` (fails on a micro-batch of another step)."""
    got: dict[int, MicroBatch] = {}
    deadline = time.monotonic() + WAIT_S
    while not got or len(got) < next(iter(got.values())).num_micro_batches:
        assert time.monotonic() < deadline, f"step {step} incomplete: {sorted(got)}"
        mb = inbox.recv(timeout_s=0.1)
        if mb is not None:
            assert isinstance(mb, MicroBatch) and mb.step == step, (mb.id, step)
            got[mb.micro_index] = mb
    return [got[k] for k in sorted(got)]


def groups_of(batches: list[MicroBatch]) -> list[str]:
    return sorted(sid for mb in batches for sid in mb.sample_ids)


def test_custody_dedupe_filter_and_redelivery_to_a_restarted_trainer(live, packer, monkeypatch):
    # the packer's inbox drops re-sent ids it remembers as done (bus.inbox.DONE_MEMORY of them);
    # remember just one, so re-sends reach the packer's own run-wide dedupe, as they do in a long run
    monkeypatch.setattr(bus.inbox, "DONE_MEMORY", 1)
    proc, thread = packer
    addr_scored, addr_batches = live.endpoints.address("scored"), live.endpoints.address("batches")
    ledger = OutcomesSink(
        live.courier(), live.endpoints.address("outcomes"), hold=True
    )  # records, does not release yet
    worker_a = live.courier().sender("scored", addr_scored, bind=False)
    worker_b = live.courier().sender("scored", addr_scored, bind=False)
    trainer_courier = live.courier()
    trainer = trainer_courier.receiver("batches", addr_batches, bind=False, accept=(MicroBatch,))

    for msg in (group("g0", [1, 0]), group("g1", [0, 1]), group("eq", [1, 1]), group("g2", [0.5, 0])):
        assert worker_a.send(msg, timeout_s=WAIT_S)
    assert worker_b.send(group("g0", [1, 0]), timeout_s=WAIT_S)  # scored twice (two workers)

    step0 = receive_step(trainer, 0)
    assert groups_of(step0) == ["g0/0", "g0/1", "g1/0", "g1/1"]
    # custody released at once for what was taken (g0, g1 in the step; g2 buffered) and the duplicate
    wait_until(lambda: worker_a.unfinished() == 1 and worker_b.unfinished() == 0, "taken and duplicate groups done")
    # the filtered group's drop reaches the ledger (reliable) and observers (control), the same message
    (drop,) = ledger.wait_for(lambda s: s.received(), "the drop of the filtered group")
    assert (type(drop), drop.group_ids, drop.reason) == (GroupsDropped, ["eq"], "filtered: equal_rewards")
    dropped = [m for m in live.announcements() if isinstance(m, GroupsDropped)]
    assert [(m.id, m.group_ids, m.reason) for m in dropped] == [(drop.id, ["eq"], "filtered: equal_rewards")]

    # the trainer holds step 0 until a checkpoint: the packer keeps it; a restarted trainer gets it again
    assert proc.batches.unfinished() == len(step0)
    live.close_courier(trainer_courier)  # goodbye without done: the packer must re-send step 0
    trainer2 = live.courier().receiver("batches", addr_batches, bind=False, accept=(MicroBatch,))
    again = receive_step(trainer2, 0)
    assert [mb.id for mb in again] == [mb.id for mb in step0]
    trainer2.done(*[mb.id for mb in again])  # a checkpoint covers step 0
    wait_until(lambda: proc.batches.unfinished() == 0, "step 0 done")

    # all this while the ledger had not recorded the drop: the filtered group stayed with its worker
    assert worker_a.unfinished() == 1 and proc.outcomes.unfinished() == 1
    assert ledger.release() == [drop.id]  # recorded now (and later outcomes are released at once)
    wait_until(lambda: worker_a.unfinished() == 0, "the filtered group released once its drop was recorded")
    wait_until(lambda: proc.outcomes.unfinished() == 0, "the drop report done")

    # much later every one of them comes back (a reward worker re-sends after a restart): nothing trains twice
    for gid in ("g0", "g1", "eq", "g2"):
        assert worker_b.send(group(gid, [0, 1], version=1), timeout_s=WAIT_S)
    wait_until(lambda: worker_b.unfinished() == 0, "re-sent groups done")
    assert trainer2.recv(timeout_s=0.3) is None
    assert live.announcements() == []
    assert ledger.ids() == [drop.id]  # no second outcome for the re-sent filtered group

    assert worker_a.send(group("g3", [0, 1], version=1), timeout_s=WAIT_S)
    step1 = receive_step(trainer2, 1)
    assert groups_of(step1) == ["g2/0", "g2/1", "g3/0", "g3/1"]

    live.pub.send(RunDone(id=new_id(), step=1, reason="max_steps"))
    thread.join(timeout=WAIT_S)
    assert not thread.is_alive(), "run.done did not end the packer's loop"
    ledger.close()


def eval_group(rnd: int, task: str, i: int, rewards: list[float], size: int) -> ScoredGroup:
    """Eval group ``i`` of ``task`` in round ``rnd`` (of ``size`` groups), ids as the prompt source makes them."""
    return dataclasses.replace(
        group(f"e{rnd:06d}-{task}-{i:05d}", rewards),
        task=task,
        eval_round=rnd,
        eval_size=size,
        reward_terms={"reverse_text": list(rewards)},
    )


def test_eval_groups_are_aggregated_published_and_then_released(live, packer, monkeypatch):
    monkeypatch.setattr(bus.inbox, "DONE_MEMORY", 1)  # so a late re-send reaches the packer
    proc, thread = packer
    ledger = OutcomesSink(live.courier(), live.endpoints.address("outcomes"))
    worker = live.courier().sender("scored", live.endpoints.address("scored"), bind=False)
    trainer = live.courier().receiver("batches", live.endpoints.address("batches"), bind=False, accept=(MicroBatch,))
    # round 3: 2 reverse_text groups (equal rewards: an eval group is never filtered) + 1 countdown group
    for msg in (eval_group(3, "reverse_text", 0, [1, 1], 3), eval_group(3, "reverse_text", 1, [0, 1], 3)):
        assert worker.send(msg, timeout_s=WAIT_S)
    wait_until(
        lambda: 3 in proc.evaluation.rounds and len(proc.evaluation.rounds[3].received) == 2, "both eval groups taken"
    )
    wait_until(lambda: worker.unfinished() == 0, "the eval groups released once in the eval spool")
    assert live.announcements() == []  # the round is not complete

    failed = GroupsDropped(id=new_id(), group_ids=["e000003-countdown-00000"], reason="generation_failed")
    results: list[EvalResult] = []

    def published() -> bool:
        live.pub.send(failed)  # the producer's report; repeated until the packer's SUB has joined
        results.extend(m for m in live.announcements(quiet_s=0.1) if isinstance(m, EvalResult))
        return len(results) >= 2

    wait_until(published, "the round's eval results")
    by_task = {r.task: r for r in results}
    written = (Path(live.cfg.run_dir) / EVAL_FILE).read_text().splitlines()  # before they were published
    assert sorted(map(json.loads, written), key=str) == sorted((eval_record(r) for r in results), key=str)
    assert sorted(by_task) == ["countdown", "reverse_text"] and len(results) == 2
    rt = by_task["reverse_text"]
    assert (rt.round, rt.num_samples, rt.num_failed, rt.version_min, rt.version_max) == (3, 4, 0, 0, 0)
    assert rt.metrics == {
        "reward_mean": 0.75,
        "reward_std": pytest.approx(0.4330127),
        "completion_len_mean": 5.0,
        "reward/reverse_text": 0.75,
        "pass_at_2": 1.0,
    }
    assert (by_task["countdown"].num_samples, by_task["countdown"].num_failed, by_task["countdown"].metrics) == (
        0,
        1,
        {},
    )
    # a late re-send is released at once and answered with the round's stored results (the same
    # messages: receivers keep one per (round, task)); eval groups never train nor get outcomes
    assert worker.send(eval_group(3, "reverse_text", 0, [1, 1], 3), timeout_s=WAIT_S)
    wait_until(lambda: worker.unfinished() == 0, "the late eval group released")
    again = [m for m in live.announcements() if isinstance(m, EvalResult)]
    assert sorted(m.id for m in again) == sorted(r.id for r in results)
    assert (Path(live.cfg.run_dir) / EVAL_FILE).read_text().splitlines() == written  # written once
    assert trainer.recv(timeout_s=0.3) is None and ledger.ids() == []
    assert proc.packer.seen == set() and not proc.packer.buffer
    ledger.close()


def test_a_restarted_packer_sends_planned_steps_again_and_keeps_its_buffer(live, monkeypatch):
    monkeypatch.setattr(bus.inbox, "DONE_MEMORY", 1)  # re-sends reach the packer's own dedupe
    addr_scored, addr_batches = live.endpoints.address("scored"), live.endpoints.address("batches")
    ledger = OutcomesSink(live.courier(), live.endpoints.address("outcomes"))
    worker = live.courier().sender("scored", addr_scored, bind=False)
    trainer_courier = live.courier()
    trainer = trainer_courier.receiver("batches", addr_batches, bind=False, accept=(MicroBatch,))
    proc, thread = start_packer(live)
    for msg in (group("g0", [1, 0]), group("g1", [0, 1]), group("g2", [0.5, 0])):
        assert worker.send(msg, timeout_s=WAIT_S)
    step0 = receive_step(trainer, 0)
    wait_until(lambda: worker.unfinished() == 0, "every group released upstream (g2 buffered)")
    stop_packer(proc, thread)  # its buffer (g2) and its unreleased step 0 now live only in the spool
    live.close_courier(trainer_courier)  # and the trainer restarts too: it has trained nothing

    proc, thread = start_packer(live)
    assert proc.packer.next_step == 1 and [g.id for g in proc.packer.buffer] == ["g2"]
    trainer = live.courier().receiver("batches", addr_batches, bind=False, accept=(MicroBatch,))
    again = receive_step(trainer, 0)
    assert [(mb.id, mb.sample_ids) for mb in again] == [(mb.id, mb.sample_ids) for mb in step0]
    assert all(
        np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.advantages, b.advantages)
        for a, b in zip(again, step0)
    )
    trainer.done(*[mb.id for mb in again])
    wait_until(lambda: proc.batches.unfinished() == 0, "step 0 done to the new packer")

    assert worker.send(group("g0", [0, 1]), timeout_s=WAIT_S)  # an old group re-sent: decided before the restart
    assert worker.send(group("g3", [0, 1]), timeout_s=WAIT_S)
    step1 = receive_step(trainer, 1)
    assert groups_of(step1) == ["g2/0", "g2/1", "g3/0", "g3/1"]
    wait_until(lambda: worker.unfinished() == 0, "g0 released as a duplicate, g3 taken")
    assert ledger.ids() == []  # no outcome for the duplicate

    trained = GroupsTrained(id="trained-step-1", step=1, group_ids=["g2", "g3"])  # a checkpoint covers steps 0 and 1

    def released() -> bool:
        live.pub.send(trained)  # repeated until the packer's SUB has joined (receivers dedupe by id)
        time.sleep(0.05)
        return proc.spool.state.steps == {}

    wait_until(released, "steps 0 and 1 marked released in the spool")
    stop_packer(proc, thread)
    proc, thread = start_packer(live)
    assert (proc.packer.next_step, proc.planned, len(proc.packer.buffer)) == (2, [], 0)
    assert {"g0", "g1", "g2", "g3"} <= proc.packer.seen
    stop_packer(proc, thread)
    ledger.close()


def test_a_resumed_packer_without_spool_numbers_steps_from_the_checkpoint(live, monkeypatch):
    done = Path(live.cfg.run_dir) / "checkpoints" / "step_000003" / "DONE"
    done.parent.mkdir(parents=True)
    done.write_text("")
    monkeypatch.setenv("RLBUS_RESUME", "1")
    proc, thread = start_packer(live)
    worker = live.courier().sender("scored", live.endpoints.address("scored"), bind=False)
    trainer = live.courier().receiver("batches", live.endpoints.address("batches"), bind=False, accept=(MicroBatch,))
    for msg in (group("g0", [1, 0], version=3), group("g1", [0, 1], version=3)):
        assert worker.send(msg, timeout_s=WAIT_S)
    assert groups_of(receive_step(trainer, 3)) == ["g0/0", "g0/1", "g1/0", "g1/1"]
    stop_packer(proc, thread)
