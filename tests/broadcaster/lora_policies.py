"""A LoRA policy whose adapters carry random, non-zero weights (peft starts B at zero, which
would hide a wrong merge); shared by the broadcaster and weight-sync tests."""

from __future__ import annotations

import torch

from configs.schema import LoraSection
from trainer.state.model import load_policy


def lora_policy(path, *, rank: int = 3, alpha: float = 16.0, seed: int = 0, scale: float = 0.1):
    """A peft LoRA policy at `path` (scaling alpha / rank = 5.33.. by default: not a power of two,
    so a merge that scales at another point rounds differently) with N(0, scale^2) adapters."""
    model = load_policy(str(path), LoraSection(enabled=True, rank=rank, alpha=alpha))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model
