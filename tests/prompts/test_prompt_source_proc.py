"""Tests for prompts.proc.PromptSourceProc on real sockets: reliable ``prompts`` out, reliable
``outcomes`` in, control messages, journal, restart."""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq
from prometheus_client import REGISTRY

import prompts.proc
from bus.messages import EvalResult, GroupsDropped, GroupsTrained, Prompt, RunDone, WeightsApplied, new_id
from bus.courier import Courier
from bus.sockets import BusSocket
from bus.topics import Endpoints
from configs.schema import load_config
from prompts.proc import PromptSourceProc
from tests.socket_dirs import remove_outside_socket_dir

WAIT_S = 10.0
"""Longest a socket test waits for something that must happen, seconds."""
TIMINGS = dict(heartbeat_s=0.05, dead_after_s=0.6, ack_timeout_s=3.0)


class ProcHarness:
    """A run dir and config; the test plays the control hub (an XPUB bound at ``control_sub``),
    the producers (a :class:`bus.courier.Courier` receiver of ``prompts`` per simulated process)
    and the senders of outcome reports (one reliable ``outcomes`` sender, as the trainer and the
    packer connect theirs; it outlives prompt-source restarts)."""

    def __init__(self, tmp_path, overrides: list[str]) -> None:
        bus = [f"bus.{k}={v}" for k, v in TIMINGS.items()]
        self.cfg = load_config(None, [f"run_dir={tmp_path}", "task.num_train_examples=5", *bus, *overrides])
        self.endpoints = Endpoints("ipc", tmp_path)
        self.endpoints.ensure_dirs()
        self.ctx = zmq.Context()
        self.control = BusSocket(self.ctx, "control_sub", "send", self.endpoints.address("control_sub"), bind=True)
        self.control.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, also a repeated one
        self.couriers: list[Courier] = [Courier(zmq.Context(), **TIMINGS)]
        self.outcomes = self.couriers[0].sender("outcomes", self.endpoints.address("outcomes"), bind=False)
        self.procs: list[tuple[PromptSourceProc, threading.Thread]] = []

    def start(self) -> PromptSourceProc:
        proc = PromptSourceProc(self.cfg, "prompt-source", 0)
        proc.setup()
        while True:  # its SUB is connected once its subscription arrives: nothing published is lost
            assert self.control.sock.poll(int(WAIT_S * 1000)), "the prompt source never subscribed"
            if self.control.sock.recv()[:1] == b"\x01":
                break
        thread = threading.Thread(target=proc.run, daemon=True)
        thread.start()
        self.procs.append((proc, thread))
        return proc

    def kill(self, proc: PromptSourceProc) -> None:
        """Stop and close ``proc`` without run.done (as close to a kill as a thread allows)."""
        for entry in list(self.procs):
            if entry[0] is proc:
                self.procs.remove(entry)
                proc.stop.set()
                entry[1].join(timeout=WAIT_S)
                proc.close()

    def producer(self):
        self.couriers.append(Courier(zmq.Context(), **TIMINGS))
        return self.couriers[-1].receiver("prompts", self.endpoints.address("prompts"), bind=False, accept=(Prompt,))

    def publish(self, msg) -> None:
        assert self.control.send(msg)

    def report(self, msg: GroupsTrained | GroupsDropped) -> None:
        """Send an outcome on ``outcomes`` and wait until the prompt source marked it done, i.e.
        recorded it in its ledger (it journals before it releases)."""
        assert self.outcomes.send(msg, timeout_s=WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while self.outcomes.unfinished():
            assert time.monotonic() < deadline, f"the prompt source did not record {msg.TYPE} {msg.id}"
            time.sleep(0.01)

    def close(self) -> None:
        for proc, _ in list(self.procs):
            self.kill(proc)
        for c in self.couriers:
            c.stop.set()
            c.close()
            c.ctx.destroy(linger=0)
        self.control.close()
        self.ctx.destroy(linger=0)


@pytest.fixture
def new_harness(tmp_path):
    """``new_harness(overrides)``: a :class:`ProcHarness` in ``tmp_path``, closed after the test."""
    made = []

    def new(overrides: list[str]) -> ProcHarness:
        made.append(ProcHarness(tmp_path, overrides))
        return made[-1]

    yield new
    for h in made:
        h.close()
    remove_outside_socket_dir(tmp_path)


@pytest.fixture
def harness(new_harness):
    # 2 prompts per step, synchronous (async level 0, no prefetch: the source alone gates), 3 steps,
    # no online evaluation
    return new_harness(
        [
            "trainer.batch_size=4",
            "producers.group_size=2",
            "max_async_level=0",
            "producers.prefetch_steps=0",
            "trainer.max_steps=3",
            "eval.enabled=false",
        ]
    )


def take(inbox, n: int) -> list[Prompt]:
    """Receive exactly ``n`` prompts (marking each done), then make sure no more come."""
    got = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < n:
        assert time.monotonic() < deadline, f"got {[p.id for p in got]}, expected {n}"
        msg = inbox.recv(timeout_s=0.1)
        if msg is not None:
            got.append(msg)
            inbox.done(msg.id)
    assert inbox.recv(timeout_s=0.3) is None
    return got


def test_proc_issues_accounts_and_rebuilds_after_a_restart(harness, monkeypatch, tmp_path):
    monkeypatch.delenv("RLBUS_RESUME", raising=False)
    monkeypatch.delenv("RLBUS_RESTARTS", raising=False)
    source = harness.start()
    producer = harness.producer()
    first = take(producer, 2)  # version 0, level 0: step 0 only
    assert [(p.id, p.step) for p in first] == [("p00000000", 0), ("p00000001", 0)]
    harness.publish(WeightsApplied(id=new_id(), producer="producer-0", version=1, apply_time_s=0.1))
    second = take(producer, 2)
    assert [(p.id, p.step) for p in second] == [("p00000002", 1), ("p00000003", 1)]
    harness.report(GroupsTrained(id=new_id(), step=0, group_ids=["p00000000", "p00000001"]))
    harness.kill(source)  # it recorded the outcome (done): the journal has it
    acc = json.loads((tmp_path / "accounting.json").read_text())
    assert acc["issued"] == 4 and acc["outcomes"]["trained"] == 2
    assert acc["unresolved"] == ["p00000002", "p00000003"]

    # restarted: re-issues the unresolved prompts first (same id and content), to a new producer
    monkeypatch.setenv("RLBUS_RESTARTS", "1")
    harness.start()
    producer2 = harness.producer()
    again = take(producer2, 2)
    assert [(p.id, p.index, p.step, p.messages, p.info) for p in again] == [
        (p.id, p.index, p.step, p.messages, p.info) for p in second
    ]
    # the applied version (1) was restored from the journal: a step-1 replacement may go out at once
    harness.report(GroupsDropped(id=new_id(), group_ids=["p00000003"], reason="failed: RuntimeError"))
    (repl,) = take(producer2, 1)
    assert (repl.id, repl.step) == ("p00000004", 1)
    # as the trainer does: run.done only once its outcomes are recorded
    harness.report(GroupsTrained(id=new_id(), step=1, group_ids=["p00000002", "p00000004"]))
    harness.publish(RunDone(id=new_id(), step=1, reason="max_steps"))
    proc, thread = harness.procs[-1]
    thread.join(timeout=WAIT_S)
    assert not thread.is_alive(), "run.done did not end the prompt source's loop"
    acc = json.loads((tmp_path / "accounting.json").read_text())
    assert acc["issued"] == 5 and acc["unresolved"] == []
    assert acc["outcomes"] == {"trained": 4, "dropped_stale": 0, "filtered": 0, "failed": 1}
    assert acc["failed"] == {"p00000003": "failed: RuntimeError"}
    assert REGISTRY.get_sample_value("rlbus_accounting_unresolved") == 0


def test_proc_issues_eval_rounds_and_runs_until_run_done(new_harness, tmp_path, monkeypatch):
    monkeypatch.delenv("RLBUS_RESUME", raising=False)
    monkeypatch.delenv("RLBUS_RESTARTS", raising=False)
    monkeypatch.setattr(prompts.proc, "EVAL_FAILURES_EVERY_S", 0.2)
    h = new_harness(
        [
            "trainer.batch_size=2",
            "producers.group_size=2",
            "max_async_level=0",
            "producers.prefetch_steps=0",
            "trainer.max_steps=2",
            "eval.interval=1",
            "eval.temperature=0.4",
            "eval.tasks=[{name: reverse_text, num_examples: 2}]",
            "sampling.temp_scheduler={type: linear, start_temperature: 1.0, end_temperature: 0.6}",
        ]
    )
    h.start()
    producer = h.producer()
    got = take(producer, 3)  # step 0 (training starts first), then the base-model round 0
    assert [(p.id, p.eval_round, p.eval_size, p.temperature) for p in got] == [
        ("p00000000", -1, 0, 1.0),
        ("e000000-reverse_text-00000", 0, 2, 0.4),
        ("e000000-reverse_text-00001", 0, 2, 0.4),
    ]
    h.publish(WeightsApplied(id=new_id(), producer="producer-0", version=1, apply_time_s=0.1))
    got = take(producer, 3)  # round 1, then step 1 (the last) at the end temperature
    assert [(p.id, p.temperature) for p in got] == [
        ("e000001-reverse_text-00000", 0.4),
        ("e000001-reverse_text-00001", 0.4),
        ("p00000001", pytest.approx(0.6)),
    ]
    # an eval group that failed is announced on outcomes: ignored by the ledger, released, and
    # announced again on the control channel (for a packer that missed it) until round 1 has a result
    hub_in = BusSocket(h.ctx, "control_pub", "recv", h.endpoints.address("control_pub"), bind=True)
    hub_in.sock.send(b"\x01")  # XSUB: subscribe to everything, as the hub does
    h.report(GroupsDropped(id=new_id(), group_ids=["e000001-reverse_text-00000"], reason="failed: RuntimeError"))
    deadline = time.monotonic() + WAIT_S
    while not isinstance(msg := hub_in.recv(timeout_s=0.1), GroupsDropped):
        assert time.monotonic() < deadline, "the failed eval group was not announced again"
    assert msg.group_ids == ["e000001-reverse_text-00000"]
    source = h.procs[-1][0].source
    h.publish(
        EvalResult(
            id=new_id(),
            round=1,
            task="reverse_text",
            version_min=1,
            version_max=1,
            num_samples=2,
            num_failed=1,
            metrics={},
        )
    )
    while source.open_eval_failures():  # the round has its result: nothing to announce any more
        assert time.monotonic() < deadline, "eval.result of round 1 not taken"
        time.sleep(0.01)
    hub_in.close()
    h.report(GroupsTrained(id=new_id(), step=0, group_ids=["p00000000"]))
    h.publish(WeightsApplied(id=new_id(), producer="producer-0", version=2, apply_time_s=0.1))
    assert [p.id for p in take(producer, 2)] == ["e000002-reverse_text-00000", "e000002-reverse_text-00001"]
    h.report(GroupsTrained(id=new_id(), step=1, group_ids=["p00000001"]))
    proc, thread = h.procs[-1]
    assert thread.is_alive(), "the source must run until run.done"
    h.publish(RunDone(id=new_id(), step=1, reason="max_steps"))
    thread.join(timeout=WAIT_S)
    assert not thread.is_alive()
    acc = json.loads((tmp_path / "accounting.json").read_text())
    assert acc["issued"] == 2 and acc["outcomes"]["trained"] == 2 and acc["outcomes"]["failed"] == 0
    assert acc["num_unknown"] == 0


def test_proc_ignores_a_repeated_applied_version(harness, monkeypatch, tmp_path):
    """The hub re-sends every producer's latest ``weights.applied`` whenever a component
    subscribes: a repeat of the version already known is no news (not journaled again)."""
    monkeypatch.delenv("RLBUS_RESUME", raising=False)
    monkeypatch.delenv("RLBUS_RESTARTS", raising=False)
    harness.start()
    producer = harness.producer()
    take(producer, 2)
    applied = WeightsApplied(id=new_id(), producer="producer-0", version=1, apply_time_s=0.1)
    harness.publish(applied)
    take(producer, 2)  # step 1: the announcement was applied
    harness.publish(WeightsApplied(id=new_id(), producer="producer-0", version=1, apply_time_s=0.1))  # a catch-up
    harness.publish(RunDone(id=new_id(), step=1, reason="max_steps"))
    proc, thread = harness.procs[-1]
    thread.join(timeout=WAIT_S)
    assert not thread.is_alive(), "run.done did not end the prompt source's loop"
    notes = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [(n["producer"], n["version"]) for n in notes if n["event"] == "applied"] == [("producer-0", 1)]


def test_a_resumed_source_re_issues_unresolved_prompts_step_by_step(new_harness, monkeypatch):
    """A journal with 10 unresolved prompts (steps 0..4): the resumed source sends the re-issues
    through the async gate, so the bus (its outbox and the producer) holds only the admitted steps'
    prompts, never the whole backlog; the rest follow as the producers' version advances."""
    monkeypatch.delenv("RLBUS_RESUME", raising=False)
    monkeypatch.delenv("RLBUS_RESTARTS", raising=False)
    h = new_harness(
        [
            "trainer.batch_size=4",
            "producers.group_size=2",
            "max_async_level=1",
            "producers.prefetch_steps=0",
            "trainer.max_steps=10",
            "eval.enabled=false",
        ]
    )
    source = h.start()
    producer = h.producer()
    for v in range(4):
        h.publish(WeightsApplied(id=new_id(), producer="producer-0", version=v, apply_time_s=0.1))
        take(producer, 4 if v == 0 else 2)  # version 0: steps 0 and 1; then one more step per version
    h.kill(source)  # 10 prompts issued (steps 0..4), none with an outcome
    old = h.couriers.pop()  # and the producer goes too (a resumed run starts new ones)
    old.stop.set()
    old.close()
    old.ctx.destroy(linger=0)

    monkeypatch.setenv("RLBUS_RESUME", "1")  # a resumed run: new producers, versions not restored
    resumed = h.start()
    producer2 = h.producer()
    got = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < 4:  # version 0 (no announcement yet), level 1: steps 0 and 1 only
        assert time.monotonic() < deadline, f"got {[p.id for p in got]}"
        if (msg := producer2.recv(timeout_s=0.1)) is not None:
            got.append(msg)  # taken, not done: it stays in the source's outbox until done
    assert producer2.recv(timeout_s=0.5) is None
    assert [p.step for p in got] == [0, 0, 1, 1] and resumed.prompts.unfinished() == 4
    assert len(resumed.source.reissue) == 6  # the backlog waits in the source, not on the bus
    producer2.done(*[p.id for p in got])
    h.publish(WeightsApplied(id=new_id(), producer="producer-0", version=3, apply_time_s=0.1))
    assert [p.step for p in take(producer2, 6)] == [2, 2, 3, 3, 4, 4]
