"""Policy loading for the trainer (full fine-tuning or a peft LoRA adapter) and the weights the
producers receive: always plain Hugging Face weights, a LoRA adapter merged in
(:func:`policy_state_dict`), or the adapter alone (:func:`lora_adapter_state_dict`), which the
producers merge on their side (:mod:`broadcaster.lora`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from broadcaster.manifest import LORA_A_SUFFIX, LORA_B_SUFFIX, LORA_SCALING_SUFFIX
from configs.model_path import resolve_model_path
from configs.schema import LoraSection


def load_policy(path: str, lora: LoraSection, *, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Load the HF causal LM at ``path`` (a directory, or a hub id in the local HF cache) in
    float32, train mode, with a LoRA adapter if enabled. FileNotFoundError if it is neither; OSError
    if its files do not load."""
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(path), dtype=torch.float32, attn_implementation=attn_implementation
    )
    if lora.enabled:
        model = get_peft_model(
            model,
            LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                task_type="CAUSAL_LM",
            ),
        )
    model.train()
    return model


def base_model(model: torch.nn.Module) -> PreTrainedModel:
    """The underlying transformers model (unwraps peft)."""
    return model.get_base_model() if isinstance(model, PeftModel) else model  # type: ignore[return-value]


@torch.no_grad()
def policy_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full policy weights with HF names, float32: a plain model's ``state_dict()`` (shared, not
    copied); for a peft model each adapted weight is ``W + scaling * B @ A`` (Hu et al. 2021, eq. 3;
    peft's ``get_delta_weight``), the adapter tensors left out."""
    if not isinstance(model, PeftModel):
        return dict(model.state_dict())
    out: dict[str, torch.Tensor] = {}
    for module_name, module in base_model(model).named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            weight = module.base_layer.weight
            for adapter in module.active_adapters:
                weight = weight + module.get_delta_weight(adapter)
            out[f"{module_name}.weight"] = weight
            if getattr(module.base_layer, "bias", None) is not None:
                out[f"{module_name}.bias"] = module.base_layer.bias
    for name, tensor in base_model(model).state_dict().items():
        if "lora_" in name or ".base_layer." in name:
            continue
        out.setdefault(name, tensor)
    return out


@torch.no_grad()
def lora_adapter_state_dict(
    model: torch.nn.Module, *, include: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor]:
    """The "lora" payload of a peft model (:mod:`broadcaster.manifest`): per adapted Linear ``M``,
    ``M.lora_A.weight`` ``[r, in]``, ``M.lora_B.weight`` ``[out, r]`` (live tensors) and
    ``M.lora_scaling`` ``[]`` (alpha / r, in B's dtype), so ``W = W_base + (B @ A) * scaling`` (Hu et
    al. 2021, eq. 3); ``include``: base weights (HF names) sent whole after them. ValueError for a
    model without peft or a layer it cannot express (several adapters, DoRA, a LoRA bias,
    ``fan_in_fan_out``, a non-Linear base)."""
    if not isinstance(model, PeftModel):
        raise ValueError(
            "lora_adapter_state_dict needs a peft LoRA model; send policy_state_dict(model) for full weights"
        )
    out: dict[str, torch.Tensor] = {}
    for module_name, module in base_model(model).named_modules():
        if not (hasattr(module, "base_layer") and hasattr(module, "get_delta_weight")):
            continue
        adapters = list(module.active_adapters)
        unsupported = (
            len(adapters) != 1
            or not isinstance(module.base_layer, torch.nn.Linear)
            or getattr(module, "fan_in_fan_out", False)
            or any(getattr(module, "use_dora", {}).get(a, False) for a in adapters)
            or any(getattr(module, "lora_bias", {}).get(a, False) for a in adapters)
        )
        if unsupported:
            raise ValueError(
                f"LoRA layer {module_name!r} (adapters {adapters}, base {type(module.base_layer).__name__}) is not a "
                "single plain Linear LoRA; send merged weights (broadcast.lora_payload: merged)"
            )
        (adapter,) = adapters
        lora_b = module.lora_B[adapter].weight
        out[module_name + LORA_A_SUFFIX] = module.lora_A[adapter].weight.detach()
        out[module_name + LORA_B_SUFFIX] = lora_b.detach()
        out[module_name + LORA_SCALING_SUFFIX] = torch.tensor(
            module.scaling[adapter], dtype=lora_b.dtype, device=lora_b.device
        )
    if include is not None:
        for name, tensor in base_model(model).state_dict().items():
            if "lora_" not in name and ".base_layer." not in name and include(name):
                out[name] = tensor
    return out
