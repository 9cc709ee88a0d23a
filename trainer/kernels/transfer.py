"""Host arrays to the trainer's device without making the host wait for it.

A plain ``tensor.to("cuda")`` from ordinary (pageable) host memory is a blocking copy: the host
waits until the device has run everything queued before it, so it cannot queue the next kernels
while the device works. The trainer's micro-batch loop prepares every index and length on the
host (numpy; `trainer.forward.packed_row`) and moves the results with :func:`to_device`: from
page-locked memory and ``non_blocking=True``, the copy is queued on the current stream like a
kernel and the host goes on (PyTorch's "pinned memory" guidance, `torch.Tensor.pin_memory`; the
caching host allocator keeps the staging buffer alive until the copy has run). Elsewhere (CPU) it
is ``torch.from_numpy`` without a copy.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["host_array", "to_device"]


def to_device(
    array: np.ndarray | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``array`` as a tensor on ``device``, queued without a host sync (see the module docstring).

    Args:
        array: a host numpy array or CPU tensor (any shape; an array is copied first if it is not
            contiguous or not writable, as the zero-copy views of a received message are).
        device: where the tensor goes.
        dtype: the tensor's dtype (None: numpy's own, e.g. int64 -> torch.int64).

    Returns:
        The tensor on ``device``. On CPU it may share memory with ``array``: do not write to either.
    """
    device = torch.device(device)
    if isinstance(array, torch.Tensor):
        tensor = array
    else:
        array = np.asarray(array)
        if not (array.flags.c_contiguous and array.flags.writeable):
            array = np.array(array)
        tensor = torch.from_numpy(array)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if tensor.device == device or device.type == "cpu":
        return tensor.to(device)
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def host_array(values: torch.Tensor | np.ndarray, name: str) -> np.ndarray:
    """A host numpy array of ``values`` (a device tensor is copied back: a host sync).

    Raises:
        ValueError: ``values`` (the argument called ``name``) is neither a tensor nor array-like.
    """
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    try:
        return np.asarray(values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a tensor or an array, got {type(values).__name__}") from error
