"""Tests for trainer.state.model: loading the policy (full FT or peft LoRA) and ``policy_state_dict``,
the merged, HF-named weights the producers receive."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from configs.schema import LoraSection
from trainer.state.model import base_model, load_policy, policy_state_dict

RANK, ALPHA = 4, 8.0  # LoRA scaling = alpha / r = 2


def hf_reference(model_dir: str) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.state_dict()


def lora_policy(model_dir: str, targets: list[str] | None = None) -> PeftModel:
    section = LoraSection(enabled=True, rank=RANK, alpha=ALPHA, **({"target_modules": targets} if targets else {}))
    model = load_policy(model_dir, section)
    assert isinstance(model, PeftModel)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peft initializes lora_B to 0; make the adapter matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


IDS = torch.tensor([[5, 17, 250, 3, 99, 42, 7, 280]])


def test_full_finetune_state_dict_is_the_models_own(model_dir):
    model = load_policy(model_dir, LoraSection(enabled=False))
    assert not isinstance(model, PeftModel) and model.training
    assert all(p.requires_grad for p in model.parameters())
    sd = policy_state_dict(model)
    own = model.state_dict()
    assert list(sd) == list(own)
    for name, tensor in sd.items():
        assert tensor.data_ptr() == own[name].data_ptr(), name  # shared, not copied
    ref = hf_reference(model_dir)
    assert set(sd) == set(ref)
    for name in ref:
        assert torch.equal(sd[name], ref[name]), name


def test_lora_state_dict_names_shapes_and_merged_values(model_dir):
    model = lora_policy(model_dir)
    ref = hf_reference(model_dir)
    sd = policy_state_dict(model)
    assert set(sd) == set(ref)  # exactly the HF names: no lora_*, no base_layer
    for name, tensor in ref.items():
        assert sd[name].shape == tensor.shape and sd[name].dtype == torch.float32, name
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert set(merged) == set(ref)
    for name in ref:
        torch.testing.assert_close(sd[name], merged[name], rtol=0, atol=1e-6, msg=name)
    # by hand for one adapted layer: W + (alpha / r) * B @ A, and the adapter really changed it
    q = base_model(model).model.layers[1].self_attn.q_proj
    by_hand = q.base_layer.weight + (ALPHA / RANK) * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(sd["model.layers.1.self_attn.q_proj.weight"], by_hand, rtol=0, atol=1e-6)
    assert (
        sd["model.layers.1.self_attn.q_proj.weight"] - ref["model.layers.1.self_attn.q_proj.weight"]
    ).abs().max() > 1e-3
    # untouched parts are the base weights (q_proj has a bias in Qwen2: kept, unmodified)
    assert torch.equal(sd["model.layers.1.self_attn.q_proj.bias"], ref["model.layers.1.self_attn.q_proj.bias"])
    assert torch.equal(sd["lm_head.weight"], ref["lm_head.weight"])
    assert torch.equal(sd["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])


def test_lora_state_dict_loads_into_plain_model_with_same_logits(model_dir):
    model = lora_policy(model_dir)
    model.eval()
    fresh = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    fresh.eval()
    before = logits(fresh, IDS)
    result = fresh.load_state_dict(policy_state_dict(model), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    after = logits(fresh, IDS)
    torch.testing.assert_close(after, logits(model, IDS), rtol=1e-5, atol=1e-5)
    assert (after - before).abs().max() > 1e-3  # the adapter is in the merged weights


def test_training_model_unchanged_no_inplace_merge(model_dir):
    model = lora_policy(model_dir)
    model.eval()
    before = snapshot(model)
    out_before = logits(model, IDS)
    sd = policy_state_dict(model)
    after = snapshot(model)
    assert set(before) == set(after)
    for name in before:
        assert torch.equal(before[name], after[name]), name
    torch.testing.assert_close(logits(model, IDS), out_before, rtol=0, atol=0)
    # adapters are still active and unmerged; merged weights are new tensors
    q = base_model(model).model.layers[0].self_attn.q_proj
    assert not q.merged and "default" in q.lora_A
    assert sd["model.layers.0.self_attn.q_proj.weight"].data_ptr() != q.base_layer.weight.data_ptr()
    sd["model.layers.0.self_attn.q_proj.weight"].add_(1.0)  # writing to the result does not touch the model
    assert torch.equal(
        q.base_layer.weight, before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    )


def test_lora_subset_of_targets(model_dir):
    model = lora_policy(model_dir, targets=["v_proj", "down_proj"])
    ref = hf_reference(model_dir)
    sd = policy_state_dict(model)
    assert set(sd) == set(ref)
    changed = {n for n in ref if not torch.equal(sd[n], ref[n])}
    # only the adapted weights differ (biases of v_proj are not adapted)
    assert changed == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.v_proj", "mlp.down_proj")}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_load_policy_missing_dir(tmp_path):
    with pytest.raises(OSError):
        load_policy(str(tmp_path / "nope"), LoraSection())
