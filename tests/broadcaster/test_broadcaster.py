"""WeightBroadcaster and the manifest: pure planning, the filesystem layout, and a real gloo
broadcast to a receiver thread that decodes buckets exactly as the vLLM worker extension does."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from broadcaster.broadcaster import WeightBroadcaster, resolve_backend
from broadcaster.filesystem import is_ready, prune_versions, write_version
from broadcaster.manifest import (
    build_manifest,
    bucket_views,
    manifest_num_bytes,
    parse_dtype,
    plan_buckets,
)


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


@pytest.mark.parametrize("name", ["base_model.model.model.norm.weight",
                                  "model.layers.0.q_proj.lora_A.default.weight"])
def test_manifest_rejects_unmerged_peft_names(name):
    with pytest.raises(ValueError, match="merged"):
        build_manifest({name: torch.zeros(2)})


def test_plan_buckets_splits_on_dtype_and_size():
    manifest = build_manifest(_state_dict())
    one = plan_buckets(manifest)  # default: everything of one dtype run fits
    assert [(b.dtype, b.numel, len(b.entries)) for b in one] == [
        (torch.float32, 72, 2), (torch.bfloat16, 4, 1), (torch.float32, 32, 1)]
    small = plan_buckets(manifest, bucket_bytes=100)  # 40 floats = 160 B > 100 B: alone
    assert [[e.name for e in b.entries] for b in small] == [
        ["model.embed_tokens.weight"], ["model.layers.0.mlp.up_proj.weight"],
        ["model.norm.weight"], ["model.layers.0.mlp.down_proj.weight"]]
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
    sender = WeightBroadcaster("filesystem", out_dir=tmp_path, keep_versions=2)
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
    with pytest.raises(ValueError, match="out_dir"):
        WeightBroadcaster("filesystem")
    with pytest.raises(ValueError, match="world_size"):
        WeightBroadcaster("broadcast", world_size=1)
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("mpi")
    with pytest.raises(RuntimeError, match="init_group"):
        WeightBroadcaster("broadcast", backend="gloo").send(_state_dict(), 1)


def test_gloo_broadcast_to_a_receiver_thread():
    """Rank 0 = WeightBroadcaster; rank 1 decodes buckets like WeightSyncExtension does."""
    pytest.importorskip("vllm", reason="the stateless group helper comes from vLLM")
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bucket_bytes = 150  # forces several buckets
    sender = WeightBroadcaster("broadcast", "gloo", "127.0.0.1", port, 2,
                               bucket_bytes=bucket_bytes, timeout_s=30)
    received: list[dict[str, torch.Tensor]] = []
    errors: list[BaseException] = []
    manifest = build_manifest(_state_dict())

    def receiver() -> None:
        try:
            group = stateless_init_torch_distributed_process_group(
                "127.0.0.1", port, 1, 2, backend="gloo")
            buckets = plan_buckets(manifest, bucket_bytes)
            flats = [torch.empty(b.numel, dtype=b.dtype) for b in buckets]  # allocated once
            for _ in range(2):
                for flat in flats:
                    group.broadcast(flat, 0).wait()
                received.append({name: view.clone() for b, f in zip(buckets, flats)
                                 for name, view in bucket_views(b, f)})
        except BaseException as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    thread = threading.Thread(target=receiver)
    thread.start()
    try:
        sender.init_group()
        sds = [_state_dict(0), _state_dict(1)]
        for version, sd in enumerate(sds, start=1):
            info = sender.send(sd, version)
            assert info["method"] == "broadcast" and info["path"] is None
            assert info["num_bytes"] == manifest_num_bytes(manifest)
        thread.join(timeout=30)
    finally:
        sender.close()
    assert not errors, errors
    assert len(received) == 2
    for got, sd in zip(received, sds):
        assert set(got) == {name for name, _, _ in manifest}
        for name, tensor in got.items():
            assert torch.equal(tensor, sd[name]), name
