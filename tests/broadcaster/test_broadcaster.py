"""The two senders (`BroadcastSender`, `FilesystemSender`) and the manifest: pure planning, the filesystem layout,
and real gloo broadcasts to a producer process that decodes buckets with the vLLM worker extension's own
`BucketReceiver`: bytes arrive intact, the trainer thread is not held by a slow producer, and a failed background
transfer comes back as `SendFailed` with its payload."""

from __future__ import annotations

import socket

import pytest
import torch

from broadcaster.base import SendFailed
from broadcaster.dist_broadcast import BroadcastSender, resolve_backend
from broadcaster.filesystem import FilesystemSender, is_ready, prune_versions, write_version
from broadcaster.manifest import (
    build_manifest,
    lora_modules,
    manifest_num_bytes,
    parse_dtype,
    payload_kind,
    plan_buckets,
)
from broadcaster.buckets import BucketReceiver
from tests.weight_peer import WeightPeer


def _state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(10, 4, generator=gen)
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=gen),
        "model.norm.weight": torch.randn(4, generator=gen).to(torch.bfloat16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(4, 8, generator=gen),
        "lm_head.weight": embed,  # tied: the same tensor
    }


def test_manifest_keeps_order_and_drops_aliases():
    manifest = build_manifest(_state_dict())
    assert manifest == [
        ["model.embed_tokens.weight", "float32", [10, 4]],
        ["model.layers.0.mlp.up_proj.weight", "float32", [8, 4]],
        ["model.norm.weight", "bfloat16", [4]],
        ["model.layers.0.mlp.down_proj.weight", "float32", [4, 8]],
    ]
    assert manifest_num_bytes(manifest) == (40 + 32 + 32) * 4 + 4 * 2


def test_manifest_keeps_equal_but_distinct_tensors():
    sd = {"a": torch.zeros(3), "b": torch.zeros(3)}
    assert [name for name, _, _ in build_manifest(sd)] == ["a", "b"]


@pytest.mark.parametrize("name", ["base_model.model.model.norm.weight", "model.layers.0.q_proj.lora_A.default.weight"])
def test_manifest_rejects_unmerged_peft_names(name):
    with pytest.raises(ValueError, match="merged"):
        build_manifest({name: torch.zeros(2)})


def test_lora_payload_manifest_says_its_kind():
    sd = {
        "model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(2, 4),
        "model.layers.0.mlp.up_proj.lora_B.weight": torch.zeros(8, 2),
        "model.layers.0.mlp.up_proj.lora_scaling": torch.tensor(2.0),
        "model.norm.weight": torch.ones(4),
    }
    manifest = build_manifest(sd)
    assert payload_kind(manifest) == "lora" and payload_kind(build_manifest(_state_dict())) == "full"
    assert lora_modules(manifest) == {"model.layers.0.mlp.up_proj": (8, 2, 4)}
    assert manifest[2] == ["model.layers.0.mlp.up_proj.lora_scaling", "float32", []]
    with pytest.raises(ValueError, match="lacks"):
        build_manifest({k: v for k, v in sd.items() if "lora_B" not in k})
    with pytest.raises(ValueError, match=r"need lora_A \[r, in\]"):
        build_manifest({**sd, "model.layers.0.mlp.up_proj.lora_B.weight": torch.zeros(8, 3)})


def test_plan_buckets_splits_on_dtype_and_size():
    manifest = build_manifest(_state_dict())
    one = plan_buckets(manifest)  # default: everything of one dtype run fits
    assert [(b.dtype, b.numel, len(b.entries)) for b in one] == [
        (torch.float32, 72, 2),
        (torch.bfloat16, 4, 1),
        (torch.float32, 32, 1),
    ]
    small = plan_buckets(manifest, bucket_bytes=100)  # 40 floats = 160 B > 100 B: alone
    assert [[e.name for e in b.entries] for b in small] == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.mlp.up_proj.weight"],
        ["model.norm.weight"],
        ["model.layers.0.mlp.down_proj.weight"],
    ]
    for bucket in one:
        offsets = [e.offset for e in bucket.entries]
        sizes = [e.numel for e in bucket.entries]
        assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]
        assert sum(sizes) == bucket.numel


@pytest.mark.parametrize("bad", [["x", "float32"], ["x", "notadtype", [2]], ["x", "float32", [-1]]])
def test_plan_buckets_rejects_bad_entries(bad):
    with pytest.raises(ValueError):
        plan_buckets([bad])


def test_parse_dtype_rejects_non_dtypes():
    assert parse_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError):
        parse_dtype("Tensor")


def test_filesystem_version_layout(tmp_path):
    from safetensors.torch import load_file

    sd = _state_dict()
    sender = FilesystemSender(tmp_path, keep_versions=2)
    for version in (1, 2, 3):
        info = sender.send(sd, version)
        assert info["path"] == str(tmp_path / f"v{version}") and is_ready(info["path"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v2", "v3"]  # v1 pruned
    loaded = load_file(tmp_path / "v3" / "model.safetensors")
    assert set(loaded) == {name for name, _, _ in info["manifest"]}  # tied alias not duplicated
    for name, tensor in loaded.items():
        assert torch.equal(tensor, sd[name])
    with pytest.raises(ValueError, match="already written"):
        write_version(tmp_path, 3, sd, info["manifest"])
    assert prune_versions(tmp_path, 1) == [tmp_path / "v2"]


def test_config_errors_say_the_fix():
    with pytest.raises(ValueError, match="keep_versions"):
        FilesystemSender("weights", keep_versions=0)
    with pytest.raises(ValueError, match="world_size"):
        BroadcastSender(world_size=1)
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("mpi")
    with pytest.raises(RuntimeError, match="init_group"):
        BroadcastSender(backend="gloo").send(_state_dict(), 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_gloo_broadcast_to_a_producer_process():
    """Rank 0 = BroadcastSender; rank 1 decodes buckets with BucketReceiver, as the producers do."""
    pytest.importorskip("vllm", reason="the stateless group helper comes from vLLM")
    port = _free_port()
    bucket_bytes = 150  # forces several buckets
    sender = BroadcastSender("gloo", "127.0.0.1", port, 2, bucket_bytes=bucket_bytes, timeout_s=30)
    manifest = build_manifest(_state_dict())
    assert len(BucketReceiver(manifest, bucket_bytes).buckets) == 4
    peer = WeightPeer(port, manifest, bucket_bytes=bucket_bytes, versions=2)
    try:
        sender.init_group()
        sds = [_state_dict(0), _state_dict(1)]
        for version, sd in enumerate(sds, start=1):
            info = sender.send(sd, version)
            assert info["method"] == "broadcast" and info["path"] is None
            assert info["num_bytes"] == manifest_num_bytes(manifest)
            assert 0 <= info["blocked_s"] <= info["send_time_s"] and info["transfer_s"] >= 0
        received = peer.result()
    finally:
        sender.close()
        peer.kill()
    assert len(received) == 2
    for got, sd in zip(received, sds):
        assert list(got) == [name for name, _, _ in manifest]
        for name, tensor in got.items():
            assert torch.equal(tensor, sd[name]), name


def test_start_send_does_not_wait_for_the_producer():
    """start_send returns while the producer has not even posted its receive (it waits for an
    event set only after start_send returned); the trainer may then change its weights: the
    producer still gets the version as it was, and wait() reports the transfer."""
    pytest.importorskip("vllm", reason="the stateless group helper comes from vLLM")
    port = _free_port()
    sd = _state_dict(0)
    sent = {name: t.clone() for name, t in sd.items()}
    manifest = build_manifest(sd)
    go = WeightPeer.event()
    peer = WeightPeer(port, manifest, go=go)  # joins, then waits for `go` before receiving
    sender = BroadcastSender("gloo", "127.0.0.1", port, 2, timeout_s=30)
    try:
        sender.init_group()
        info = sender.start_send(sd, 1)
        assert sender.in_flight and "transfer_s" not in info
        for tensor in sd.values():
            tensor.zero_()  # the next optimizer step
        go.set()
        done = sender.wait()
        assert not sender.in_flight and sender.wait() is None
        assert done["version"] == 1 and done["transfer_s"] >= 0 and sender.last_transfer == done
        received = peer.result()
    finally:
        sender.close()
        peer.kill()
    for name, tensor in received[0].items():
        assert torch.equal(tensor, sent[name]), name


def test_a_failed_background_transfer_raises_send_failed_with_its_payload():
    """The producer leaves the group without receiving: the transfer fails in the background and
    the next wait() raises SendFailed naming the version and holding what was sent."""
    pytest.importorskip("vllm", reason="the stateless group helper comes from vLLM")
    port = _free_port()
    sd = _state_dict(0)
    peer = WeightPeer(port, build_manifest(sd), versions=0)  # joins the group and leaves
    sender = BroadcastSender("gloo", "127.0.0.1", port, 2, timeout_s=20)
    try:
        sender.init_group()
        assert peer.result() == []  # it has left
        sender.start_send(sd, 5)
        with pytest.raises(SendFailed) as failed:
            sender.wait()
        assert not sender.in_flight
    finally:
        sender.close()
        peer.kill()
    assert failed.value.version == 5 and isinstance(failed.value, RuntimeError)
    assert set(failed.value.payload) == {name for name, _, _ in build_manifest(sd)}
    for name, tensor in failed.value.payload.items():
        assert torch.equal(tensor, sd[name]), name
