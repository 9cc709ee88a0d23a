"""Host arrays to the trainer's device without making the host wait for it.

A ``.to("cuda")`` from pageable memory blocks the host until the device catches up; :func:`to_device`
copies from pinned memory with ``non_blocking=True`` (PyTorch's pinned-memory guidance). On CPU it is
``torch.from_numpy``, without a copy.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["host_array", "to_device"]


def to_device(
    array: np.ndarray | torch.Tensor, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``array`` (numpy or CPU tensor; copied first when not contiguous or read-only) as a ``dtype`` tensor on
    ``device`` (None: its own dtype), queued without a host sync; on CPU it may share ``array``'s memory.
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
    """A host numpy array of ``values`` (a device tensor is copied back: a host sync); else ValueError."""
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().numpy()
    try:
        return np.asarray(values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name} must be a tensor or an array, got {type(values).__name__}") from error
