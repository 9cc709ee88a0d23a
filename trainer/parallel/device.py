"""The trainer rank's device: where :func:`trainer_device` says the policy (and so every tensor the
trainer builds from it) lives.

``busctl up`` resolves ``trainer.device`` (``auto`` -> ``cuda`` or ``cpu``, :mod:`busctl.placement`)
and starts the trainer with ``CUDA_VISIBLE_DEVICES`` listing its devices, so inside the process
``cuda`` is ``cuda:0`` for a single rank and ``cuda:LOCAL_RANK`` for data-parallel rank
``LOCAL_RANK`` (:class:`trainer.parallel.distributed.DataParallel` picks that one from its backend). A
config that was not resolved by busctl (tests, a hand-started trainer) resolves ``auto`` here
the same way, from what torch sees.

Invariant: the model is moved to this device once, right after loading; the micro-batch arrays,
the reference policy (a copy of the moved model) and teacher logprobs follow the model's device
(:meth:`trainer.trainer.Trainer.micro_step`).
"""

from __future__ import annotations

import torch

from configs.schema import RunConfig
from trainer.parallel.distributed import DataParallel


def trainer_device(cfg: RunConfig, dp: DataParallel | None) -> torch.device:
    """The device of this trainer rank.

    Args:
        cfg: the run config (``trainer.device``: ``auto``, ``cpu`` or ``cuda``).
        dp: this rank's data-parallel group (``trainer.data_parallel > 1``), or None.

    Returns:
        ``dp.device`` for a data-parallel rank; else ``cuda`` (the first visible device) or ``cpu``.

    Raises:
        ValueError: ``trainer.device`` is ``cuda`` but torch sees no CUDA device, or it disagrees
            with the data-parallel group's device (set by ``trainer.dp_backend``).
    """
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
