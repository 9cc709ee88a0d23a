"""The trainer's precision policy (``trainer.dtype``): in which dtype the policy computes.

``float32``: everything in float32, as the parameters are. ``bfloat16``: mixed precision, the
policy of torchtitan (its defaults ``mixed_precision_param = "bfloat16"``,
``mixed_precision_reduce = "float32"``, i.e. FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)``) and of Micikevicius et al. 2018 ("Mixed Precision Training",
arXiv:1710.03740, section 3.1), with bfloat16 instead of float16 so no loss scaling is needed:
- master weights stay float32: the parameters, their gradients (autograd accumulates a bfloat16
  matmul's weight gradient into the float32 ``.grad`` of the parameter it was cast from), the
  AdamW moments and the checkpoints never see bfloat16;
- the forward (and so its backward) of the policy runs under ``torch.autocast(device_type,
  dtype=torch.bfloat16)``: autocast casts the weights to bfloat16 for the matmuls (linear, sdpa)
  and keeps reductions, norms and softmax in float32 (its "fp32 list");
- logprobs and the loss stay float32: the LM head runs with autocast switched off
  (:mod:`trainer.forward.logprobs`), its matmuls in ``trainer.lm_head_dtype`` (TF32 by default on
  CUDA, float32 on CPU: float32 logits; bfloat16 logits, 8 bits of mantissa, ~0.06 absolute error
  on a logit of 16, only when chosen) and its log-softmax in float32, since the head's error goes
  into every logprob and importance ratio; MiniMax-M1 (arXiv:2506.13585, its RL section) traced its
  training/inference probability mismatch to the LM head's precision and fixed it with a float32 head;
- gradients are reduced across ranks in float32 (DDP reduces the float32 ``.grad``; FSDP2 takes
  ``reduce_dtype=float32`` in its own policy): nothing to do here.

The autocast context is independent of how the model is wrapped (DDP, FSDP2 ``fully_shard``
with its own ``MixedPrecisionPolicy``, activation checkpointing, whose recomputation restores the
autocast state of the forward), so it composes with all of them. The frozen reference policy of
the KL penalty runs in the same compute dtype (its logprobs are then the policy's at step 0
exactly, so the KL starts at 0); see :mod:`trainer.forward.reference`.

Invariants: :meth:`PrecisionPolicy.autocast` changes no parameter, buffer or optimizer state;
under ``float32`` it is a no-op context.
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
    """The compute dtype of the trainer's forwards (see the module docstring).

    Args:
        compute_dtype: torch.float32 (no autocast) or torch.bfloat16 (autocast to bfloat16).

    Raises:
        ValueError: another dtype.
    """

    compute_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.compute_dtype not in COMPUTE_DTYPES.values():
            raise ValueError(f"compute_dtype must be torch.float32 or torch.bfloat16, got {self.compute_dtype!r}")

    @classmethod
    def from_name(cls, name: str) -> "PrecisionPolicy":
        """The policy of a ``trainer.dtype`` value ("float32" | "bfloat16").

        Raises:
            ValueError: another name.
        """
        if name not in COMPUTE_DTYPES:
            raise ValueError(f"trainer.dtype must be one of {sorted(COMPUTE_DTYPES)}, got {name!r}")
        return cls(COMPUTE_DTYPES[name])

    @property
    def mixed(self) -> bool:
        """True when the compute dtype is narrower than the float32 parameters (autocast on)."""
        return self.compute_dtype != torch.float32

    def autocast(self, device: torch.device | str) -> ContextManager[None]:
        """Context for a forward on ``device`` (its type picks the autocast backend: "cpu",
        "cuda"): ``torch.autocast(device.type, dtype=compute_dtype)`` when mixed, else a no-op.

        Wrap the forward only; the backward runs outside it (autograd replays each op in the
        dtype its forward used, as torch's autocast docs prescribe).
        """
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.compute_dtype)
