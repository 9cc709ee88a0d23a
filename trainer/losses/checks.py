"""The loss's value checks, on host arrays: they never make the host wait for a device.

`policy_loss` must refuse a micro-batch whose sample lengths do not split it, whose step
normalizers do not cover it, or whose sampler logprobs / advantages / teacher logprobs are not
finite on a loss token (each would silently mis-scale or poison the step). Checking those values
where they live on a GPU reads them back to the host, a sync per check. The trainer receives them
as host arrays anyway (`bus.messages.MicroBatch`), so it calls :func:`check_loss_inputs` on those
before the forward and builds its `LossBatch` with ``checked=True``; a `LossBatch` built without
that flag is checked here on host copies of its tensors (`trainer.losses.policy.policy_loss_terms`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from trainer.forward.packed_row import check_seq_lens, sample_starts
from trainer.losses.spec import StepNorm

__all__ = ["check_loss_inputs"]


def check_loss_inputs(
    loss_mask: np.ndarray, seq_lens: np.ndarray, norm: StepNorm, inputs: Mapping[str, np.ndarray | None]
) -> None:
    """Check one micro-batch's loss inputs on the host (see the module docstring).

    Args:
        loss_mask: ``[T]`` bool, the loss tokens.
        seq_lens: ``[S]`` integer sample lengths.
        norm: the step's normalizers; they must cover this micro-batch's loss tokens and samples
            with a loss token (else the step loss is mis-scaled).
        inputs: ``{name: [T] float array or None}``, the inputs that must be finite on loss tokens
            (None entries are skipped).

    Raises:
        ValueError: seq_lens do not split T (`check_seq_lens`), norm is not a `StepNorm` or is below
            this micro-batch's counts, or an input is not ``[T]`` or not finite on a loss token (the
            message names the input, the value and the token index).
    """
    mask = np.asarray(loss_mask, dtype=bool)
    lens = check_seq_lens(seq_lens, len(mask))
    if not isinstance(norm, StepNorm):
        raise ValueError(f"norm must be a StepNorm, got {type(norm).__name__}")
    local_tokens = int(mask.sum())
    per_sample = np.add.reduceat(mask.astype(np.int64), sample_starts(lens))  # loss tokens per sample (lens >= 1)
    local_samples = int((per_sample > 0).sum())
    if norm.loss_tokens < local_tokens or norm.num_samples < local_samples:
        raise ValueError(
            f"StepNorm(loss_tokens={norm.loss_tokens}, num_samples={norm.num_samples}) is below this micro-batch's "
            f"{local_tokens} loss tokens / {local_samples} samples with loss tokens; pass the counts of the WHOLE "
            "optimizer step (all micro-batches, all ranks)"
        )
    for name, values in inputs.items():
        if values is None:
            continue
        values = np.asarray(values)
        if values.shape != mask.shape:
            raise ValueError(f"{name} must be [{len(mask)}] like loss_mask, got shape {values.shape}")
        bad = np.flatnonzero(mask & ~np.isfinite(values))
        if len(bad):
            index = int(bad[0])
            raise ValueError(
                f"{name} must be finite on loss tokens, got {float(values[index])} at token {index}; "
                "fix the producer/reward worker output or set loss_mask False there"
            )
