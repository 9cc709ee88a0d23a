"""Policy loading for the trainer: full fine-tuning or a peft LoRA adapter, and the weights that
the producers receive.

Producers always run plain (merged) weights with Hugging Face parameter names, whatever the
trainer trains: with LoRA, :func:`policy_state_dict` merges the adapter into a copy of each
adapted weight (``W + scale * B @ A``, Hu et al. 2021, eq. 3) without touching the training model.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from configs.schema import LoraSection


def load_policy(path: str, lora: LoraSection, *, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Load the HF causal LM at ``path`` in float32, wrapped with a LoRA adapter if enabled.

    Raises:
        OSError: ``path`` is not a model directory.
    """
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation
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
