"""The trainer rank's device (:func:`trainer_device`): the policy is moved there once after loading,
and every tensor the trainer builds follows it. ``busctl up`` resolves ``trainer.device`` and sets
``CUDA_VISIBLE_DEVICES``, so ``cuda`` is ``cuda:0`` for one rank and ``cuda:LOCAL_RANK`` for a
data-parallel rank; a config busctl did not resolve (tests) resolves ``auto`` here the same way.
"""

from __future__ import annotations

import torch

from configs.schema import RunConfig
from trainer.parallel.distributed import DataParallel


def trainer_device(cfg: RunConfig, dp: DataParallel | None) -> torch.device:
    """The device of this trainer rank: ``dp.device`` for a data-parallel rank, else ``cuda:0`` or
    CPU by ``trainer.device``. ValueError for ``cuda`` without a CUDA device, or one that disagrees
    with the data-parallel group's (``trainer.dp_backend``)."""
    asked = cfg.trainer.device
    if asked == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "trainer.device is cuda but torch sees no CUDA device (a CPU build of torch, no driver, or "
            "CUDA_VISIBLE_DEVICES empty); set trainer.device: cpu (or auto)"
        )
    if dp is not None:
        if asked != "auto" and dp.device.type != asked:
            raise ValueError(
                f"trainer.device is {asked} but the data-parallel ranks run on {dp.device.type} "
                f"(trainer.dp_backend {cfg.trainer.dp_backend} -> {dp.backend}); make them agree"
            )
        return dp.device
    if asked == "cuda" or (asked == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")
