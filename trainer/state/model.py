"""Policy loading for the trainer: full fine-tuning or a peft LoRA adapter, and the weights that
the producers receive.

Producers always run plain (merged) weights with Hugging Face parameter names, whatever the
trainer trains: with LoRA, :func:`policy_state_dict` merges the adapter into a copy of each
adapted weight (``W + scale * B @ A``, Hu et al. 2021, eq. 3) without touching the training model.
Or the trainer sends only the adapter, :func:`lora_adapter_state_dict` (the "lora" payload of
``broadcaster.manifest``), and the producers do the same merge on their side
(``broadcaster.lora``).
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
    """Load the HF causal LM at ``path`` in float32, wrapped with a LoRA adapter if enabled.

    ``path``: a model directory or a hub id in the local HF cache (:func:`configs.model_path.resolve_model_path`).

    Raises:
        FileNotFoundError: ``path`` is neither a model directory nor in the local HF cache.
        OSError: the directory's files do not load.
    """
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
    """Full policy weights with HF names, LoRA deltas merged in: ``{name: tensor}``, float32.

    For a plain model this is its ``state_dict()`` (tensors shared, not copied). For a peft
    model each adapted layer's weight is ``W + scaling * B @ A`` (computed by peft's
    ``get_delta_weight``); adapter tensors themselves are left out.
    """
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
    """The "lora" weight payload of a peft model (``broadcaster.manifest``): per adapted linear
    module ``M`` (HF module name) ``M.lora_A.weight`` ``[r, in]``, ``M.lora_B.weight`` ``[out, r]``
    (the live adapter tensors, not copies) and ``M.lora_scaling`` ``[]`` (peft's ``scaling``,
    lora_alpha / r, in B's dtype), so that ``W = W_base + (B @ A) * scaling`` (Hu et al. 2021,
    eq. 3; peft's ``get_delta_weight``) rebuilds :func:`policy_state_dict`'s merged weight.

    ``include``: base-model weights (HF names, e.g. ``broadcaster.noise.is_rmsnorm_weight``) to
    send whole alongside the adapter; they follow the adapter entries, in state-dict order.

    Raises:
        ValueError: not a peft model, or an adapted layer this payload cannot express (several
            active adapters, DoRA, a LoRA bias, ``fan_in_fan_out``, a non-Linear base layer):
            send :func:`policy_state_dict` (merged weights) instead.
    """
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
