"""Weights travel in the producers' dtype (`producers.dtype`): the manifest's wire dtype, the
senders' cast on the way (a real gloo broadcast to a producer process decoding with the worker's
`BucketReceiver`, and the filesystem writer), the trainer's publisher (bytes halved in bfloat16),
and the LoRA merge, which runs in float32 whatever the factors' dtype."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from broadcaster.dist_broadcast import BroadcastSender
from broadcaster.dtypes import resolve_producer_dtype
from broadcaster.filesystem import FilesystemSender
from broadcaster.lora import merge_lora_delta
from broadcaster.manifest import build_manifest, manifest_num_bytes
from configs.schema import RunConfig
from tests.broadcaster.lora_policies import lora_policy
from tests.broadcaster.test_broadcaster import _free_port
from tests.weight_peer import WeightPeer
from trainer.state.model import lora_adapter_state_dict, policy_state_dict
from trainer.publish import WeightPublisher, weights_dtype, weights_payload


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(10, 4, generator=gen)
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, 4, generator=gen),
        "model.norm.weight": torch.randn(4, generator=gen),
        "lm_head.weight": embed,  # tied: the same tensor, listed once
    }


def test_resolve_producer_dtype():
    assert resolve_producer_dtype("auto", cuda_available=True) == "bfloat16"
    assert resolve_producer_dtype("auto", cuda_available=False) == "float32"
    assert resolve_producer_dtype("bfloat16", cuda_available=False) == "bfloat16"
    assert resolve_producer_dtype("float32", cuda_available=True) == "float32"
    with pytest.raises(ValueError, match="producers.dtype"):
        resolve_producer_dtype("float16", cuda_available=True)


def test_manifest_wire_dtype_keeps_lora_factors_and_integers():
    state = {
        **_state(),
        "model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 4),
        "model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(4, 2),
        "model.layers.0.self_attn.q_proj.lora_scaling": torch.tensor(2.0),
        "model.counter": torch.arange(3),
    }
    manifest = build_manifest(state, torch.bfloat16)
    dtypes = {name: dtype for name, dtype, _ in manifest}
    assert dtypes == {
        "model.embed_tokens.weight": "bfloat16",
        "model.layers.0.mlp.up_proj.weight": "bfloat16",
        "model.norm.weight": "bfloat16",
        "model.layers.0.self_attn.q_proj.lora_A.weight": "float32",
        "model.layers.0.self_attn.q_proj.lora_B.weight": "float32",
        "model.layers.0.self_attn.q_proj.lora_scaling": "float32",
        "model.counter": "int64",
    }
    full = {n: t for n, t in _state().items()}
    assert manifest_num_bytes(build_manifest(full, torch.bfloat16)) * 2 == manifest_num_bytes(build_manifest(full))


def test_gloo_broadcast_casts_to_the_wire_dtype():
    pytest.importorskip("vllm", reason="the stateless group helper comes from vLLM")
    port, bucket_bytes = _free_port(), 64  # several buckets
    sender = BroadcastSender("gloo", "127.0.0.1", port, 2, bucket_bytes=bucket_bytes, timeout_s=30)
    state = _state(3)
    manifest = build_manifest(state, torch.bfloat16)
    peer = WeightPeer(port, manifest, bucket_bytes=bucket_bytes)
    try:
        sender.init_group()
        info = {**sender.start_send(state, 1, manifest), **sender.wait()}
        received = peer.result()[0]
    finally:
        sender.close()
        peer.kill()
    assert info["num_bytes"] == manifest_num_bytes(manifest) == 2 * (40 + 32 + 4)
    assert list(received) == [n for n, _, _ in manifest]
    for name, tensor in received.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name].to(torch.bfloat16)), name
    assert state["model.norm.weight"].dtype == torch.float32  # the sender's tensors are not touched


def test_publisher_sends_bfloat16_files_of_half_the_bytes(tmp_path):
    """`producers.dtype: bfloat16`: the filesystem version holds bfloat16 tensors equal to the
    rounded float32 weights, half the bytes of a float32 run's; float32 sends them as they are."""
    infos = {}
    for dtype in ("float32", "bfloat16"):
        cfg = RunConfig.model_validate({"producers": {"dtype": dtype}})
        assert weights_dtype(cfg) == getattr(torch, dtype)
        announced = []
        publisher = WeightPublisher.for_run(
            cfg, torch.nn.Linear(4, 8), FilesystemSender(tmp_path / dtype), None, announced.append
        )
        publisher.payload = lambda version, adapter: _state()
        publisher.publish(1)
        (msg,) = announced
        assert {d for _, d, _ in msg.manifest} == {dtype}
        with safe_open(f"{msg.path}/model.safetensors", framework="pt") as f:
            for name in f.keys():
                assert torch.equal(f.get_tensor(name), _state()[name].to(getattr(torch, dtype))), name
        infos[dtype] = msg.num_bytes
    assert infos["bfloat16"] * 2 == infos["float32"] == 4 * (40 + 32 + 4)
    assert weights_dtype(RunConfig()) == (torch.bfloat16 if torch.cuda.is_available() else torch.float32)  # auto


def test_lora_payload_merges_in_float32(tiny_policy):
    """A LoRA policy's adapter payload in a bfloat16 run: factors travel float32, and the merge
    (here with a bfloat16 base, as a bfloat16 checkpoint gives) computes in float32, so the
    merged weight cast to bfloat16 equals the full payload's bfloat16 weight bit for bit."""
    model = lora_policy(tiny_policy)
    cfg = RunConfig.model_validate({"producers": {"dtype": "bfloat16"}})
    adapter = weights_payload(model, cfg, 1, adapter=True)
    manifest = build_manifest(adapter, torch.bfloat16)
    assert {d for _, d, _ in manifest} == {"float32"}  # factors only, no whole tensors without noise
    full = policy_state_dict(model)
    name = "model.layers.0.self_attn.q_proj"
    base = model.get_base_model().state_dict()[f"{name}.base_layer.weight"]
    merged = merge_lora_delta(
        base, adapter[f"{name}.lora_A.weight"], adapter[f"{name}.lora_B.weight"], adapter[f"{name}.lora_scaling"]
    )
    assert merged.dtype == torch.float32
    assert torch.equal(merged.to(torch.bfloat16), full[f"{name}.weight"].to(torch.bfloat16))
    low = merge_lora_delta(
        base.to(torch.bfloat16),
        adapter[f"{name}.lora_A.weight"].to(torch.bfloat16),
        adapter[f"{name}.lora_B.weight"].to(torch.bfloat16),
        adapter[f"{name}.lora_scaling"],
    )
    assert low.dtype == torch.float32  # bfloat16 inputs are widened before the product
    assert lora_adapter_state_dict(model)[f"{name}.lora_A.weight"].dtype == torch.float32
