"""A spy on the torch operations that make the host wait for an accelerator (CPU tests).

On CUDA, reading a device value on the host (``.item()``, ``float(t)``, ``int(t)``, ``bool(t)``,
``.tolist()``) and every operation whose OUTPUT SIZE depends on device values
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without
``output_size``) block the host until the device has run everything queued before them, so the
host stops queueing kernels ahead of the device. On a CPU these cost nothing, so a CPU test cannot
time them; but it can see them: every one of them reaches torch's dispatcher as one of the aten
operations below (``_local_scalar_dense`` is what item/float/int/bool call), and ``tolist`` is
patched on ``torch.Tensor`` for the duration. The device check of the same rule is
``torch.cuda.set_sync_debug_mode("error")`` in tests/gpu.

What it cannot see on a CPU: a device-to-host read through ``.cpu()`` / ``.numpy()`` or a blocking
host-to-device copy (``.to("cuda")`` without ``non_blocking``), since a CPU has one device and
host-side numpy views of host tensors are legitimate; the code routes its host-to-device copies
through one helper (:func:`trainer.kernels.transfer.to_device`) and tests/gpu checks the rest.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SYNCING_OPS = {
    aten._local_scalar_dense.default: "item/float/int/bool of a tensor",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.is_nonzero.default: "is_nonzero",
    aten.equal.default: "torch.equal",
    aten._unique2.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.unique_dim.default: "unique(dim)",
}


def _bool_index(args) -> bool:
    """Whether an index/index_put call indexes with a boolean mask (it runs nonzero inside)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostSyncSpy(TorchDispatchMode):
    """Records every operation that would block the host on CUDA (see the module docstring).

    ``found``: one ``(what, where)`` per such operation, ``where`` the innermost frame outside
    torch (``file:line``), to name the culprit in a failing assertion.
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def note(self, what: str) -> None:
        frames = [
            f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename and "host_sync" not in f.filename
        ]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        self.found.append((what, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING_OPS:
            self.note(SYNCING_OPS[func])
        elif func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and _bool_index(args):
            self.note(f"{func} with a boolean mask")
        elif func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.note("repeat_interleave without output_size")
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_syncs() -> Iterator[HostSyncSpy]:
    """Within the block, every would-be host sync is recorded in the yielded spy's ``found``."""
    spy = HostSyncSpy()
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist",)}

    def patched(name):
        def method(self, *args, **kwargs):
            spy.note(f"Tensor.{name}")
            return originals[name](self, *args, **kwargs)

        return method

    for name in originals:
        setattr(torch.Tensor, name, patched(name))
    try:
        with spy:
            yield spy
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
