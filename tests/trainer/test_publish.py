"""trainer.publish.WeightPublisher: the announcement order of each method and the fallback swap
(a broadcast sender that fails at once: it never formed its group), with real senders."""

from __future__ import annotations

import pytest
import torch

from broadcaster.dist_broadcast import BroadcastSender
from broadcaster.filesystem import FilesystemSender, is_ready
from trainer.publish import WeightPublisher


def _payload(version: int, *, adapter: bool) -> dict[str, torch.Tensor]:
    return {"model.norm.weight": torch.full((4,), float(version)), "adapter" if adapter else "merged": torch.zeros(1)}


def test_a_failed_broadcast_swaps_in_the_filesystem_sender(tmp_path):
    announced = []
    publisher = WeightPublisher(
        BroadcastSender(backend="gloo"), FilesystemSender(tmp_path), announced.append, _payload, adapter=True
    )
    try:
        publisher.publish(1)  # start_send raises (no group): announced, then re-published by filesystem
        publisher.publish(2)
    finally:
        publisher.close()
    assert [(m.version, m.method) for m in announced] == [(1, "broadcast"), (1, "filesystem"), (2, "filesystem")]
    assert announced[0].path == "" and [n for n, _, _ in announced[0].manifest] == ["model.norm.weight", "adapter"]
    assert all(is_ready(m.path) for m in announced[1:])
    assert [n for n, _, _ in announced[1].manifest] == ["model.norm.weight", "merged"]  # filesystem: merged weights
    assert isinstance(publisher.sender, FilesystemSender) and publisher.fallback is None


def test_without_a_fallback_a_failure_raises(tmp_path):
    publisher = WeightPublisher(BroadcastSender(backend="gloo"), None, lambda msg: None, _payload, adapter=False)
    with pytest.raises(RuntimeError, match="init_group"):
        publisher.publish(1)
    writes = []
    publisher = WeightPublisher(FilesystemSender(tmp_path), None, writes.append, _payload, adapter=True)
    publisher.publish(3)
    publisher.settle()  # nothing in flight
    with pytest.raises(ValueError, match="already written"):
        publisher.publish(3)
    assert [(m.version, m.method) for m in writes] == [(3, "filesystem")]


def test_a_late_joiner_gets_the_last_version_through_the_fallback_once(tmp_path):
    """weights.wanted from a producer outside the group: the publisher switches to its fallback and
    re-publishes the last version there (a primary that worked stands in for a formed broadcast)."""
    announced = []
    publisher = WeightPublisher(
        FilesystemSender(tmp_path / "primary"),
        FilesystemSender(tmp_path / "fallback"),
        announced.append,
        _payload,
        adapter=False,
    )
    try:
        publisher.serve_late_joiner("producer-1", 0)  # nothing published yet: nothing to re-publish
        assert announced == [] and publisher.fallback is not None
        publisher.publish(3)
        publisher.serve_late_joiner("producer-1", 3)
        publisher.serve_late_joiner("producer-1", 3)  # already switched: the next publication serves it
        publisher.publish(4)
    finally:
        publisher.close()
    assert [m.version for m in announced] == [3, 3, 4]
    assert [m.path.startswith(str(tmp_path / "fallback")) for m in announced] == [False, True, True]
    assert all(is_ready(m.path) for m in announced) and publisher.fallback is None


def test_a_failed_broadcast_swaps_in_the_bus_fallback_which_serves_the_adapter(tmp_path):
    """`broadcast.fallback: bus`: the failed version goes out over the bus (an adapter payload: the
    bus method carries adapters), a producer's fetcher pulls exactly it, and the members gauge
    counts the producer under the bus method."""
    import zmq
    from prometheus_client import REGISTRY

    from broadcaster.buckets import BucketReceiver
    from broadcaster.bus_fetch import BusFetcher
    from broadcaster.bus_method import BusSender

    ctx = zmq.Context()
    address = f"ipc://{tmp_path}/weights"
    announced = []
    publisher = WeightPublisher(
        BroadcastSender(backend="gloo"),
        BusSender(ctx, address),
        announced.append,
        _payload,
        adapter=True,
        members=["producer-0"],
    )
    fetcher = BusFetcher(address, producer="producer-0", retry_s=0.5)
    try:
        publisher.publish(1)
        assert [(m.version, m.method) for m in announced] == [(1, "broadcast"), (1, "bus")]
        assert announced[1].path == "" and [n for n, _, _ in announced[1].manifest] == ["model.norm.weight", "adapter"]
        assert REGISTRY.get_sample_value("rlbus_trainer_weight_members", {"method": "bus"}) == 1
        assert REGISTRY.get_sample_value("rlbus_trainer_weight_members", {"method": "broadcast"}) == 0
        result = fetcher.fetch(BucketReceiver(announced[1].manifest), 1, timeout_s=60)
        assert result.version == 1 and torch.equal(result.views["model.norm.weight"], torch.full((4,), 1.0))
    finally:
        fetcher.close()
        publisher.close()
        ctx.term()
