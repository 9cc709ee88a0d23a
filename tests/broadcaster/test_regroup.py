"""Weight groups that re-form (`broadcaster.regroup`, `trainer.publish.WeightPublisher`), over real
gloo groups: the trainer-side publisher (real `BroadcastSender`s and `FilesystemSender`) and
producer-side `BroadcastReceiver`s whose engine is the vLLM worker extension's own code
(`WeightSyncExtension.init_weight_group` / `destroy_weight_group` / `receive_weights`, with the
vLLM model reload replaced by reporting what arrived), each producer in its own process with its
own event loop, as in a run. The control channel between them is a pair of queues (what the hub
would forward).

- a third producer asks to join (`weights.wanted`): the group re-forms with all three, the last
  version is re-sent into it (the newcomer gets it bit-identically, the old members take it
  again), and the next version reaches all three;
- a member that stopped listening (dead) makes a re-form time out: it alone moves to the
  filesystem method, the group re-forms without it, and the others stay on broadcast;
- a restarted trainer (a new publisher with ``rejoin``, the producers still in the dead one's
  group) starts on the filesystem method; the producers' latest ``weights.applied`` (the hub's
  catch-up) make its first publication form a new group with both: its checkpoint's version and
  the next go by broadcast.
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from broadcaster.filesystem import FilesystemSender, is_ready
from broadcaster.regroup import GroupFormer, Membership, listening_socket
from broadcaster.dist_broadcast import BroadcastSender
from bus.messages import WeightsApplied, WeightsReady, new_id
from bus.messages_weights import WeightGroup
from trainer.publish import GROUP_REFORMS, WEIGHT_MEMBERS, WeightPublisher

from tests.broadcaster.regroup_producer import REFORM_TIMEOUT_S, Producer

pytest.importorskip("vllm", reason="the stateless group helper comes from vLLM")


def _payload(version: int, *, adapter: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(version)
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=gen),
        "model.norm.weight": torch.randn(8, generator=gen),
        "lm_head.weight": torch.randn(16, 8, generator=gen),
    }


class _Run:
    """A publisher whose first group (producer-0, producer-1) forms at start, fanning every
    control message out to the producers."""

    def __init__(self, tmp_path) -> None:
        self.to_trainer = Producer.trainer_inbox()  # from the producer processes
        self.from_hub: queue.Queue = queue.Queue()  # what the test says as the hub would
        self.announced: list = []
        self.producers: list[Producer] = []
        sock = listening_socket("127.0.0.1")
        port = sock.getsockname()[1]
        sender = BroadcastSender("gloo", "127.0.0.1", port, 3, timeout_s=30, listen_socket=sock)
        for i in range(2):
            self.producers.append(Producer(f"producer-{i}", i, self.to_trainer, in_group=True, port=port, world_size=3))
        sender.open()
        self.publisher = WeightPublisher(
            sender,
            FilesystemSender(tmp_path / "weights"),
            self._fan_out,
            _payload,
            adapter=False,
            former=GroupFormer("gloo", "127.0.0.1", timeout_s=REFORM_TIMEOUT_S),
            members=["producer-0", "producer-1"],
            inbox=self._recv,
        )

    def _fan_out(self, msg) -> None:
        self.announced.append(msg)
        for producer in self.producers:
            producer.inbox.put(msg)

    def _recv(self, timeout_s: float):
        try:
            return self.from_hub.get_nowait()
        except queue.Empty:
            pass
        try:
            return self.to_trainer.get(timeout=timeout_s) if timeout_s else self.to_trainer.get_nowait()
        except queue.Empty:
            return None

    def add(self, name: str, index: int) -> Producer:
        producer = Producer(name, index, self.to_trainer, in_group=False, port=1, world_size=2)
        self.producers.append(producer)
        return producer

    def restart_trainer(self, tmp_path) -> WeightPublisher:
        """A new publisher as a restarted trainer builds it (``factory.build_senders(restarted=True)``:
        the filesystem sender is also the fallback); the dead one's is kept to be closed last."""
        self.dead = self.publisher
        filesystem = FilesystemSender(tmp_path / "weights-restarted")
        filesystem.open()
        self.publisher = WeightPublisher(
            filesystem,
            filesystem,
            self._fan_out,
            _payload,
            adapter=False,
            former=GroupFormer("gloo", "127.0.0.1", timeout_s=REFORM_TIMEOUT_S),
            members=["producer-0", "producer-1"],
            inbox=self._recv,
            rejoin=True,
        )
        return self.publisher

    def wait_for(self, producers, version: int, count: int) -> None:
        """Poll the publisher (as the trainer does while waiting for data) until each producer in
        `producers` has `count` loads of `version`."""
        for _ in range(600):
            self.publisher.poll()
            for producer in producers:
                producer.refresh()
            if all(sum(1 for _, v in p.versions if v == version) >= count for p in producers):
                return
            threading.Event().wait(0.05)
        raise AssertionError(f"version {version} x{count} not loaded: {[(p.versions, p.errors) for p in producers]}")

    def close(self) -> None:
        for producer in self.producers:
            producer.stop()
        self.publisher.close()
        if getattr(self, "dead", None) is not None:
            self.dead.close()


def _groups(announced: list) -> list[tuple]:
    """The groups announced, each once (a group being formed is announced again every
    `broadcaster.regroup.REANNOUNCE_S`; the repeats carry the same generation and port)."""
    seen = {
        (m.generation, m.port): (m.generation, tuple(m.members), tuple(m.filesystem))
        for m in announced
        if isinstance(m, WeightGroup)
    }
    return list(seen.values())


def _counts() -> tuple[float, float]:
    return (GROUP_REFORMS.labels(outcome="ok")._value.get(), GROUP_REFORMS.labels(outcome="failed")._value.get())


def test_a_joining_producer_re_forms_the_group_and_gets_the_last_version_bit_identically(tmp_path):
    run = _Run(tmp_path)
    ok0, failed0 = _counts()
    try:
        run.publisher.publish(1)
        run.wait_for(run.producers, 1, 1)
        newcomer = run.add("producer-2", 2)
        run.wait_for([newcomer], 1, 1)  # poll() saw weights.wanted: re-formed, re-sent version 1
        run.wait_for(run.producers[:2], 1, 2)  # the old members took part in the re-send
        run.publisher.publish(2)
        run.wait_for(run.producers, 2, 1)
    finally:
        run.close()
    assert all(not p.errors for p in run.producers), [p.errors for p in run.producers]
    assert _counts() == (ok0 + 1, failed0)
    assert run.publisher.method == "broadcast"
    assert run.publisher.membership == Membership(1, ("producer-0", "producer-1", "producer-2"))
    assert WEIGHT_MEMBERS.labels(method="broadcast")._value.get() == 3
    assert _groups(run.announced) == [(1, ("producer-0", "producer-1", "producer-2"), ())]
    assert {m.method for m in run.announced if isinstance(m, WeightsReady)} == {"broadcast"}
    assert newcomer.versions == [("broadcast", 1), ("broadcast", 2)]
    assert run.producers[0].versions == [("broadcast", 1), ("broadcast", 1), ("broadcast", 2)]
    for producer in run.producers:
        last = producer.loaded[-1]
        for name, tensor in _payload(2, adapter=False).items():
            assert torch.equal(last[name], tensor), (producer.name, name)
    for name, tensor in _payload(1, adapter=False).items():
        assert torch.equal(newcomer.loaded[0][name], tensor), name


def test_a_re_form_that_times_out_moves_only_the_silent_member_to_the_filesystem_method(tmp_path):
    run = _Run(tmp_path)
    ok0, failed0 = _counts()
    try:
        run.publisher.publish(1)
        run.wait_for(run.producers, 1, 1)
        run.producers[1].deafen()  # dead: it will never acknowledge a new group
        newcomer = run.add("producer-2", 2)
        run.wait_for([newcomer], 1, 1)  # after one timed-out attempt and one without producer-1
        run.wait_for([run.producers[0]], 1, 2)
        run.publisher.publish(2)
        run.wait_for([run.producers[0], newcomer], 2, 1)
    finally:
        run.close()
    assert all(not p.errors for p in run.producers), [p.errors for p in run.producers]
    assert _counts() == (ok0 + 1, failed0 + 1)
    assert run.publisher.membership == Membership(2, ("producer-0", "producer-2"), ("producer-1",))
    assert run.publisher.method == "broadcast"  # the others stay on broadcast
    assert WEIGHT_MEMBERS.labels(method="broadcast")._value.get() == 2
    assert WEIGHT_MEMBERS.labels(method="filesystem")._value.get() == 1
    assert _groups(run.announced) == [
        (1, ("producer-0", "producer-1", "producer-2"), ()),
        (2, ("producer-0", "producer-2"), ("producer-1",)),
    ]
    # each version from then on goes out by broadcast, then by filesystem for producer-1
    ready = [(m.version, m.method) for m in run.announced if isinstance(m, WeightsReady)]
    assert ready == [(1, "broadcast"), (1, "broadcast"), (1, "filesystem"), (2, "broadcast"), (2, "filesystem")]
    assert all(is_ready(m.path) for m in run.announced if isinstance(m, WeightsReady) and m.method == "filesystem")
    assert newcomer.versions == [("broadcast", 1), ("broadcast", 2)]
    for name, tensor in _payload(2, adapter=False).items():
        assert torch.equal(newcomer.loaded[-1][name], tensor), name


def test_membership_moves_producers_between_methods_and_refuses_overlaps():
    first = Membership(0, ("producer-0", "producer-1"))
    joined = first.next(add=["producer-2", "producer-0"])  # a restarted member stays where it was
    assert joined == Membership(1, ("producer-0", "producer-1", "producer-2"))
    blamed = joined.next(drop=["producer-1"])
    assert blamed == Membership(2, ("producer-0", "producer-2"), ("producer-1",))
    assert blamed.next(add=["producer-1"]) == Membership(3, ("producer-0", "producer-2", "producer-1"))
    assert blamed.next(drop=["producer-0", "producer-2"]).members == ()
    with pytest.raises(ValueError, match="disjoint"):
        Membership(0, ("producer-0",), ("producer-0",))
    with pytest.raises(ValueError, match="reform timeout"):
        GroupFormer("gloo", "127.0.0.1", timeout_s=0)


def test_a_restarted_trainer_re_forms_the_group_with_the_producers_of_the_dead_ones(tmp_path):
    run = _Run(tmp_path)
    ok0, failed0 = _counts()
    try:
        run.publisher.publish(1)
        run.publisher.publish(2)
        run.wait_for(run.producers, 2, 1)
        restarted = run.restart_trainer(tmp_path)  # resumed from its checkpoint of version 1
        assert (restarted.method, WEIGHT_MEMBERS.labels(method="filesystem")._value.get()) == ("filesystem", 2)
        while run._recv(0.5) is not None:  # what the dead trainer did not read dies with it ...
            pass
        for producer in run.producers:  # ... and the hub's catch-up tells the new one who runs what
            run.from_hub.put(WeightsApplied(id=new_id(), producer=producer.name, version=2, apply_time_s=0.0))
        announced = len(run.announced)
        restarted.publish(1)
        run.wait_for(run.producers, 1, 2)
        restarted.publish(2)
        run.wait_for(run.producers, 2, 2)
    finally:
        run.close()
    assert all(not p.errors for p in run.producers), [p.errors for p in run.producers]
    assert _counts() == (ok0 + 1, failed0)
    assert restarted.method == "broadcast"
    assert sorted(restarted.membership.members) == ["producer-0", "producer-1"] and not restarted.membership.filesystem
    assert restarted.membership.generation > 10**12  # milliseconds: never one of the dead trainer's
    assert WEIGHT_MEMBERS.labels(method="broadcast")._value.get() == 2
    assert {m.method for m in run.announced[announced:] if isinstance(m, WeightsReady)} == {"broadcast"}
    for producer in run.producers:
        assert producer.versions[-3:] == [("broadcast", 2), ("broadcast", 1), ("broadcast", 2)], producer.name
        for name, tensor in _payload(2, adapter=False).items():
            assert torch.equal(producer.loaded[-1][name], tensor), (producer.name, name)
