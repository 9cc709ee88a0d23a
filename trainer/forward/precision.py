"""The trainer's precision policy (``trainer.dtype``): in which dtype the policy computes.

``bfloat16`` is mixed precision as in torchtitan (FSDP2 ``param_dtype=bfloat16, reduce_dtype=float32``)
and Micikevicius et al. 2018 (arXiv:1710.03740, section 3.1), without loss scaling: parameters,
gradients, AdamW state and checkpoints stay float32, the forward runs under ``torch.autocast``. The LM
head and the loss stay float32, as MiniMax-M1 (arXiv:2506.13585) fixed its training/inference mismatch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ContextManager

import torch

__all__ = ["COMPUTE_DTYPES", "PrecisionPolicy"]

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``trainer.dtype`` values -> the torch dtype the policy's matmuls run in."""


@dataclass(frozen=True)
class PrecisionPolicy:
    """The compute dtype of the trainer's forwards, torch.float32 or torch.bfloat16; ValueError otherwise."""

    compute_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES.values():
            raise ValueError(f"compute_dtype must be torch.float32 or torch.bfloat16, got {self.compute_dtype!r}")

    @classmethod
    def from_name(cls, name: str) -> "PrecisionPolicy":
        """The policy of a ``trainer.dtype`` name; ValueError for another name."""
        if name not in COMPUTE_DTYPES:
            raise ValueError(f"trainer.dtype must be one of {sorted(COMPUTE_DTYPES)}, got {name!r}")
        return cls(COMPUTE_DTYPES[name])

    @property
    def mixed(self) -> bool:
        """True when the compute dtype is narrower than the float32 parameters (autocast on)."""
        return self.compute_dtype != torch.float32

    def autocast(self, device: torch.device | str) -> ContextManager[None]:
        """``torch.autocast(device.type, compute_dtype)`` when mixed, else a no-op; wrap the forward only."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.compute_dtype)
