"""``trainer.compile``: each decoder layer of the policy compiled with ``torch.compile``, as torchtitan does.

Inductor (Ansel et al. 2024, "PyTorch 2", ASPLOS) fuses a layer's element-wise work, which at 0.5B
weighs as much as its matmuls. Per layer (torchtitan's ``apply_compile``; LoRA, FSDP2, activation
checkpointing unaffected), dynamic shapes; the packed attention stays outside the graphs. Off by
default (the first step pays the compile); speed-ups: bench/README.md.
"""

from __future__ import annotations

import torch

from trainer.state.model import base_model

__all__ = ["COMPILE_BACKENDS", "compile_decoder_layers"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""``trainer.compile_backend`` values: ``inductor`` generates fused kernels (the one that speeds
up); ``aot_eager`` traces forward and backward but runs them eagerly (checks tracing, fast to
compile); ``eager`` traces the forward only."""


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile ``model``'s ``get_decoder().layers`` in place with ``backend``; returns how many.
    ValueError for an unknown backend or a model without them.
    """
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"trainer.compile_backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
    layers = getattr(base_model(model).get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(
            f"{type(base_model(model)).__name__} has no decoder layers to compile (get_decoder().layers); "
            "set trainer.compile: false"
        )
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)
    return len(layers)
