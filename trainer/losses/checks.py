"""The loss's value checks on host arrays, so they never make the host wait for a device.

The trainer runs :func:`check_loss_inputs` on a micro-batch's host arrays before the forward and
builds its `LossBatch` with ``checked=True``; an unchecked `LossBatch` is checked on host copies.
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
    """Check that ``seq_lens`` ``[S]`` splits ``loss_mask`` ``[T]``, ``norm`` covers its counts and each
    ``inputs`` ``[T]`` array is finite on loss tokens; ValueError naming the input and token otherwise.
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
