"""The producers' dtype (`producers.dtype`): what vLLM computes in and what the weights travel in.

One value decides both: the producers' engines run in it (`producers.engine.RolloutEngine`'s
vLLM `dtype`) and the trainer sends the floating-point weights of each version in it
(`trainer.publish.WeightPublisher`; bfloat16: half the bytes of float32), so a producer loads
exactly the tensors its engine holds and no receiver converts anything.

`busctl up` resolves "auto" to a concrete value in the run config it saves; this function is the
rule it follows, and what a component sees when it gets "auto" anyway (tests, a component started
by hand): "auto" = bfloat16 where CUDA is available (the GPU's native matmul dtype; vLLM's own
default for a bfloat16 checkpoint), float32 on CPU (exact agreement with the float32 trainer,
and the CPU default of the tiny job).

This module imports nothing (no torch), so configs and `busctl` may use it cheaply; callers
pass `cuda_available` (`torch.cuda.is_available()` where torch is loaded).
"""

from __future__ import annotations

__all__ = ["PRODUCER_DTYPES", "resolve_producer_dtype"]

PRODUCER_DTYPES = ("auto", "bfloat16", "float32")
"""The values of `producers.dtype`."""


def resolve_producer_dtype(name: str, *, cuda_available: bool) -> str:
    """The concrete producers' dtype of a `producers.dtype` value: "bfloat16" or "float32".

    Args:
        name: "auto", "bfloat16" or "float32".
        cuda_available: whether the resolving process sees a CUDA device.

    Returns: `name` itself unless it is "auto"; then "bfloat16" with CUDA, "float32" without.

    Raises:
        ValueError: another name.
    """
    if name not in PRODUCER_DTYPES:
        raise ValueError(f"producers.dtype must be one of {PRODUCER_DTYPES}, got {name!r}")
    if name == "auto":
        return "bfloat16" if cuda_available else "float32"
    return name
