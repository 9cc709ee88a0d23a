"""``trainer.compile``: each decoder layer of the policy compiled with ``torch.compile``, as torchtitan does.

TorchDynamo + Inductor (Ansel et al. 2024, "PyTorch 2", ASPLOS) fuse a layer's element-wise chains
(RMSNorm, RoPE, SiLU, residual adds, casts), which at 0.5B weigh as much as its matmuls on a GPU.
As in torchtitan's ``apply_compile``, each layer is compiled on its own (``nn.Module.compile``:
LoRA, FSDP2 and activation checkpointing work as without it) with dynamic shapes, one compile for
all micro-batch lengths. The packed attention stays outside the graphs (``torch.compiler.disable``):
its inputs change every micro-batch. Off by default: the first step pays the compile. Measured
speed-ups: bench/README.md.
"""

from __future__ import annotations

import torch

from trainer.model import base_model

__all__ = ["COMPILE_BACKENDS", "compile_decoder_layers"]

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""``trainer.compile_backend`` values: ``inductor`` generates fused kernels (the one that speeds
up); ``aot_eager`` traces forward and backward but runs them eagerly (checks tracing, fast to
compile); ``eager`` traces the forward only."""


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Compile each decoder layer (``get_decoder().layers``) of ``model``, peft-wrapped or not, in place with
    ``backend``, one of :data:`COMPILE_BACKENDS`; returns the number of layers compiled.

    Raises:
        ValueError: an unknown backend, or a model without ``get_decoder().layers``.
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
