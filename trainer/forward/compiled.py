"""``trainer.compile``: each decoder layer of the policy compiled with ``torch.compile``, as torchtitan does.

At 0.5B parameters a decoder layer's matmuls are small (hidden 896), so its element-wise work
(RMSNorm in float32 with its casts, RoPE, SiLU x up, residual adds, autocast casts) and the
launches of ~100 eager kernels per layer and micro-batch weigh as much as the matmuls on a GPU.
``torch.compile`` (TorchDynamo + Inductor, Ansel et al. 2024, "PyTorch 2", ASPLOS) fuses those
element-wise chains into a few generated kernels. Following torchtitan's per-block compile
(``apply_compile`` in its parallelize step, "compile each TransformerBlock"), each layer is
compiled on its own (``nn.Module.compile``: the module keeps its parameters, so peft's LoRA
modules inside it, FSDP2 and activation checkpointing work as without compile), with dynamic
shapes, since every packed micro-batch has another token count: one compile for all lengths.

The packed attention (`trainer.forward.packed_attention.packed_sdpa_attention`) runs outside the
compiled graphs (``torch.compiler.disable``): its inputs (the sample lengths, the shared-prefix
plan) change with every micro-batch, and its work is one flash-attention call on a GPU already.
So each layer is two graphs (before and after attention), compiled once per process.

Measured (NVIDIA H200, torch 2.11, a random Qwen2.5-0.5B-shaped policy, `bench.gpu_trainer`,
bench/README.md): with 32768-token micro-batches the uniform batch's step went 0.366 -> 0.264 s
(26.8% -> 37.2% MFU) and the GRPO-shaped batch's 0.524 -> 0.404 s, with less peak memory (58.5 ->
40.9 GiB, 48.2 -> 30.9 GiB); at 16384 tokens the uniform batch reached 32.6% MFU. Still off by
default, as in torchtitan and prime-rl: the first step pays the compile (tens of seconds on a GPU
host; about 80 s for a 2-layer tiny model with Inductor on the 2-core CPU host), a CPU run gains
nothing, and Inductor's support varies with the installed torch. configs/gsm8k_qwen_1gpu.yaml turns
it on.
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
    """Compile each decoder layer of ``model`` in place (see the module docstring).

    Args:
        model: a transformers causal LM, possibly peft-wrapped, whose decoder (``get_decoder()``)
            holds its layers as ``.layers`` (Qwen2/Qwen3/Llama and kin).
        backend: a ``torch.compile`` backend of :data:`COMPILE_BACKENDS`.

    Returns:
        The number of layers compiled.

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
