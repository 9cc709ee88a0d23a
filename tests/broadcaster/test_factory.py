"""broadcaster.factory: which sender, fallback and receiver each `broadcast.method` gets, the
supervisor's rendezvous-port question, and how a producer's receiver routes announcements
(to a recording engine: the engine is not what is under test here)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from broadcaster.base import FallbackReceiver
from broadcaster.dist_broadcast import BroadcastReceiver, BroadcastSender
from broadcaster.factory import build_receiver, build_senders, needs_rendezvous_port
from broadcaster.filesystem import FilesystemReceiver, FilesystemSender
from bus.messages import WeightsReady, new_id
from bus.messages_weights import WeightGroup
from configs.schema import BroadcastConfig


class RecordingEngine:
    """Records the RolloutEngine calls a receiver makes."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def init_weight_group(self, host, port, *, rank, world_size, backend, timeout_s) -> None:
        self.calls.append(("join", port, rank, world_size, backend))

    async def leave_weight_group(self) -> None:
        self.calls.append(("leave",))

    async def update_weights(self, version, manifest, resend=False) -> None:
        self.calls.append(("resend" if resend else "broadcast", version))

    async def load_weights_from_path(self, version, path) -> None:
        self.calls.append(("filesystem", version, path))


def _ready(version: int, method: str) -> WeightsReady:
    path = {"filesystem": f"/w/v{version}"}.get(method, "")
    return WeightsReady(
        id=new_id(), version=version, method=method, manifest=[["w", "float32", [1]]], path=path, num_bytes=4
    )


def test_senders_per_method(tmp_path):
    sender, fallback = build_senders(BroadcastConfig(backend="gloo", port=1234), world_size=3, out_dir=tmp_path)
    assert isinstance(sender, BroadcastSender) and (sender.port, sender.world_size, sender.backend) == (1234, 3, "gloo")
    assert isinstance(fallback, FilesystemSender) and fallback.out_dir == tmp_path
    sender, fallback = build_senders(BroadcastConfig(method="filesystem"), world_size=3, out_dir=tmp_path)
    assert isinstance(sender, FilesystemSender) and fallback is None
    sender, fallback = build_senders(BroadcastConfig(backend="gloo"), world_size=3, out_dir=tmp_path, restarted=True)
    assert isinstance(sender, FilesystemSender) and fallback is sender  # until a re-formed group replaces it
    sender, fallback = build_senders(
        BroadcastConfig(method="filesystem"), world_size=3, out_dir=tmp_path, restarted=True
    )
    assert isinstance(sender, FilesystemSender) and fallback is None
    assert BroadcastSender.carries_adapter and not FilesystemSender.carries_adapter


def test_rendezvous_port_only_for_an_unset_broadcast_port():
    assert needs_rendezvous_port(BroadcastConfig(port=0))
    assert not needs_rendezvous_port(BroadcastConfig(port=29555))
    assert not needs_rendezvous_port(BroadcastConfig(method="filesystem", port=0))
    with pytest.raises(ValueError, match="broadcast.method"):
        needs_rendezvous_port(SimpleNamespace(method="nccl", port=0))


def test_a_broadcast_producer_joins_and_takes_both_methods():
    engine = RecordingEngine()
    receiver = build_receiver(BroadcastConfig(backend="gloo", port=7), engine, rank=2, world_size=3, in_group=True)
    assert isinstance(receiver, FallbackReceiver) and isinstance(receiver.primary, BroadcastReceiver)

    async def run() -> None:
        await receiver.join()
        for msg in (_ready(1, "broadcast"), _ready(2, "filesystem")):
            assert receiver.skip_reason(msg, current_version=0) is None
            await receiver.apply(msg)

    asyncio.run(run())
    assert engine.calls == [("join", 7, 2, 3, "gloo"), ("broadcast", 1), ("filesystem", 2, "/w/v2")]
    assert receiver.skip_reason(_ready(1, "broadcast"), current_version=2) is not None  # not sent again
    assert receiver.skip_reason(_ready(1, "filesystem"), current_version=2) is None  # a resumed trainer's rollback
    with pytest.raises(ValueError, match="'carrier'"):
        receiver.skip_reason(SimpleNamespace(method="carrier", version=3), 0)


def test_a_late_producer_skips_broadcasts_and_a_filesystem_run_never_joins():
    engine = RecordingEngine()
    late = build_receiver(BroadcastConfig(backend="gloo"), engine, rank=1, world_size=2, in_group=False)
    asyncio.run(late.join())
    assert engine.calls == []
    assert "not in the weight group" in late.skip_reason(_ready(5, "broadcast"), current_version=0)
    assert late.skip_reason(_ready(5, "filesystem"), current_version=0) is None
    receiver = build_receiver(BroadcastConfig(method="filesystem"), engine, rank=1, world_size=2, in_group=True)
    assert isinstance(receiver, FilesystemReceiver)
    asyncio.run(receiver.join())
    asyncio.run(receiver.apply(_ready(3, "filesystem")))
    assert engine.calls == [("filesystem", 3, "/w/v3")]


def test_a_late_producer_asks_joins_a_re_formed_group_takes_the_resend_and_leaves_when_dropped():
    engine = RecordingEngine()
    late = build_receiver(
        BroadcastConfig(backend="gloo"), engine, rank=2, world_size=2, in_group=False, name="producer-1"
    )
    acks = []
    group = WeightGroup(
        id=new_id(), generation=1, host="127.0.0.1", port=4321, members=["producer-0", "producer-1"], filesystem=[]
    )
    assert late.wants_group
    assert asyncio.run(late.regroup(group, lambda: acks.append(1)))
    assert acks == [1] and not late.wants_group
    assert engine.calls == [("join", 4321, 2, 3, "gloo")]  # rank 2 of 3 in the new group, not the configured one
    assert late.must_apply(_ready(4, "broadcast"), current_version=4)  # every member receives the resend
    assert not late.must_apply(_ready(4, "filesystem"), current_version=4)
    asyncio.run(late.apply(_ready(4, "broadcast")))
    assert engine.calls[-1] == ("resend", 4) and not late.must_apply(_ready(4, "broadcast"), current_version=4)
    calls = list(engine.calls)
    assert asyncio.run(late.regroup(group, lambda: acks.append(2)))  # a repeat: still in, nothing happens
    assert engine.calls == calls
    dropped = WeightGroup(
        id=new_id(), generation=2, host="127.0.0.1", port=4322, members=["producer-0"], filesystem=["producer-1"]
    )
    assert not asyncio.run(late.regroup(dropped, lambda: acks.append(3)))
    assert engine.calls[-1] == ("leave",) and acks == [1]
    assert (
        late.skip_reason(_ready(5, "broadcast"), current_version=4)
        and late.skip_reason(_ready(5, "filesystem"), 4) is None
    )
    assert not late.wants_group  # told to take the filesystem method: it does not ask again
    unknown = WeightGroup(
        id=new_id(), generation=1_700_000_000_000, host="127.0.0.1", port=4323, members=["producer-0"], filesystem=[]
    )  # a restarted trainer that never heard of it
    assert not asyncio.run(late.regroup(unknown, lambda: acks.append(4)))
    assert acks == [1] and late.wants_group  # listed nowhere: it asks to be taken in, as a newcomer does


def test_the_factory_imports_no_torch():
    """busctl asks `needs_rendezvous_port` before any component starts: no torch import for that."""
    import subprocess
    import sys

    code = "import sys, broadcaster.factory; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
