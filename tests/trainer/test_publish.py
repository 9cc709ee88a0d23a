"""trainer.publish.WeightPublisher: the announcement order of each method and the fallback swap
(a broadcast sender that fails at once: it never formed its group), with real senders."""

from __future__ import annotations

import pytest
import torch

from broadcaster.broadcast import BroadcastSender
from broadcaster.filesystem import FilesystemSender, is_ready
from trainer.publish import WeightPublisher


def _payload(version: int, *, adapter: bool) -> dict[str, torch.Tensor]:
    return {"model.norm.weight": torch.full((4,), float(version)), "adapter" if adapter else "merged": torch.zeros(1)}


def test_a_failed_broadcast_swaps_in_the_filesystem_sender(tmp_path):
    announced = []
    publisher = WeightPublisher(BroadcastSender(backend="gloo"), FilesystemSender(tmp_path), announced.append,
                                _payload, adapter=True)
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
    publisher = WeightPublisher(FilesystemSender(tmp_path / "primary"), FilesystemSender(tmp_path / "fallback"),
                                announced.append, _payload, adapter=False)
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
