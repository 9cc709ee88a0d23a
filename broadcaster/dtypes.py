"""The producers' dtype (`producers.dtype`): what vLLM computes in and what the weights travel in.
One value decides both, so a producer loads exactly the tensors its engine holds and no receiver converts.
"auto" = bfloat16 with CUDA (vLLM's default for a bfloat16 checkpoint), float32 on CPU (agrees exactly with the
float32 trainer); `busctl up` resolves it into the saved run config. No torch import: configs and busctl use it.
"""

from __future__ import annotations

__all__ = ["PRODUCER_DTYPES", "resolve_producer_dtype"]

PRODUCER_DTYPES = ("auto", "bfloat16", "float32")
"""The values of `producers.dtype`."""


def resolve_producer_dtype(name: str, *, cuda_available: bool) -> str:
    """ "bfloat16" or "float32" for a `producers.dtype` value ("auto" by `cuda_available`); ValueError otherwise."""
    if name not in PRODUCER_DTYPES:
        raise ValueError(f"producers.dtype must be one of {PRODUCER_DTYPES}, got {name!r}")
    if name == "auto":
        return "bfloat16" if cuda_available else "float32"
    return name
