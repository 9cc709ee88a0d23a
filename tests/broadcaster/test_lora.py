"""LoRA adapter payloads: extraction from a real peft model, the receiver-side merge, and that the
merged result equals the trainer's merged weights bit for bit (also through a real gloo broadcast)."""

from __future__ import annotations

import socket

import pytest
import torch
from safetensors.torch import load_file

from broadcaster.dist_broadcast import BroadcastSender
from broadcaster.lora import merge_lora_delta, merged_weights
from broadcaster.manifest import build_manifest, lora_modules, manifest_num_bytes, payload_kind
from broadcaster.noise import is_rmsnorm_weight
from configs.schema import LoraSection
from trainer.state.model import load_policy, lora_adapter_state_dict, policy_state_dict

from tests.broadcaster.lora_policies import lora_policy
from tests.weight_peer import WeightPeer

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_merge_lora_delta_by_hand():
    base = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    lora_a = torch.tensor([[1.0, -1.0]])  # [r=1, in=2]
    lora_b = torch.tensor([[2.0], [0.5]])  # [out=2, r=1]
    # B @ A = [[2, -2], [0.5, -0.5]]; * 3 = [[6, -6], [1.5, -1.5]]; + base:
    expected = torch.tensor([[7.0, -4.0], [4.5, 2.5]])
    assert torch.equal(merge_lora_delta(base, lora_a, lora_b, torch.tensor(3.0)), expected)
    with pytest.raises(ValueError, match="do not chain"):
        merge_lora_delta(base, lora_a, lora_b.T, 3.0)


def test_adapter_payload_names_shapes_and_kind(tiny_policy):
    model = lora_policy(tiny_policy)
    payload = lora_adapter_state_dict(model)
    manifest = build_manifest(payload)
    assert payload_kind(manifest) == "lora"
    modules = lora_modules(manifest)
    assert sorted(modules) == sorted(
        f"model.layers.{i}.{part}.{t}"
        for i in range(2)
        for t in TARGETS
        for part in (["self_attn"] if t.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else ["mlp"])
    )
    full = policy_state_dict(model)
    for module, (out_f, rank, in_f) in modules.items():
        assert rank == 3 and tuple(full[f"{module}.weight"].shape) == (out_f, in_f)
        assert payload[f"{module}.lora_scaling"].item() == pytest.approx(16.0 / 3)
    assert payload_kind(build_manifest(full)) == "full"
    # the wire carries r * (in + out) per module instead of out * in: far fewer bytes
    assert manifest_num_bytes(manifest) < manifest_num_bytes(build_manifest(full)) / 5


def test_receiver_merge_equals_the_trainers_merged_weights_exactly(tiny_policy):
    model = lora_policy(tiny_policy)
    base = load_file(tiny_policy / "model.safetensors")  # what a producer keeps from load time
    merged = dict(merged_weights(base, lora_adapter_state_dict(model)))
    expected = policy_state_dict(model)
    assert list(merged) == list(base) and set(merged) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name


def test_include_sends_whole_norms_that_replace_the_base(tiny_policy):
    model = lora_policy(tiny_policy)
    payload = lora_adapter_state_dict(model, include=is_rmsnorm_weight)
    norms = [n for n in payload if is_rmsnorm_weight(n)]
    assert len(norms) == 2 * 2 + 1  # input + post-attention per layer, final model.norm
    payload = {**payload, **{n: payload[n] + 1.0 for n in norms}}
    merged = dict(merged_weights(load_file(tiny_policy / "model.safetensors"), payload))
    for n in norms:
        assert torch.equal(merged[n], payload[n])


def test_merge_refuses_a_payload_of_another_model(tiny_policy):
    model = lora_policy(tiny_policy)
    payload = lora_adapter_state_dict(model)
    base = load_file(tiny_policy / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="not weights of the base model"):
        merged_weights({k: v for k, v in base.items() if k != name}, payload)
    with pytest.raises(ValueError, match="must serve the trainer's base"):
        merged_weights({**base, name: base[name][:, :-1]}, payload)
    with pytest.raises(ValueError, match="lacks"):
        merged_weights(base, {k: v for k, v in payload.items() if not k.endswith("down_proj.lora_scaling")})


def test_extraction_refuses_what_the_payload_cannot_express(tiny_policy):
    with pytest.raises(ValueError, match="peft"):
        lora_adapter_state_dict(load_policy(str(tiny_policy), LoraSection()))


def test_adapter_through_gloo_then_merged_equals_the_trainer(tiny_policy):
    """The adapter goes through BroadcastSender (background transfer) to a producer process
    decoding it like the vLLM worker extension; merged with the base, it equals policy_state_dict."""
    pytest.importorskip("vllm", reason="the stateless group helper comes from vLLM")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = lora_policy(tiny_policy)
    payload = lora_adapter_state_dict(model)
    manifest = build_manifest(payload)
    peer = WeightPeer(port, manifest)
    sender = BroadcastSender("gloo", "127.0.0.1", port, 2, timeout_s=30)
    try:
        sender.init_group()
        info = sender.send(payload, 1)
        received = peer.result()[0]
    finally:
        sender.close()
        peer.kill()
    merged = dict(merged_weights(load_file(tiny_policy / "model.safetensors"), received))
    assert info["num_bytes"] == manifest_num_bytes(manifest)
    for name, tensor in policy_state_dict(model).items():
        assert torch.equal(merged[name], tensor), name
