"""A packed row's structure, worked out on the host before its forward, so the forward never waits.

Every index a packed forward needs follows from host arrays; computing it on the device
(``nonzero``, ``.tolist()``) would make the host wait. :meth:`PackedRow.build` uses numpy and
queues the copies (:func:`trainer.kernels.transfer.to_device`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainer.forward.packed_attention import SeqLens
from trainer.forward.shared_prefix import SharedPrefixPlan, plan_shared_prefixes
from trainer.kernels.transfer import host_array, to_device

__all__ = ["PackedRow", "check_seq_lens", "sample_starts"]


def sample_starts(lens: np.ndarray) -> np.ndarray:
    """``[S]`` int64 index of each packed sample's first token: ``[0, l0, l0 + l1, ...]``."""
    return np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)


@dataclass(frozen=True)
class PackedRow:
    """One packed row on the model's device: `lens` ``[S]`` host, `at`, `hidden_rows`, `targets` ``[R]``,
    `decoder_ids`, `position_ids` ``[1, T_d]`` int64, and the `attention` keyword of the packed attention.
    """

    num_tokens: int
    lens: np.ndarray
    at: torch.Tensor
    hidden_rows: torch.Tensor
    targets: torch.Tensor
    decoder_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: dict

    @property
    def decoder_tokens(self) -> int:
        """T_d, the tokens the decoder runs."""
        return int(self.decoder_ids.shape[1])

    @classmethod
    def build(
        cls,
        input_ids: torch.Tensor | np.ndarray,
        seq_lens: torch.Tensor | np.ndarray,
        tokens: torch.Tensor | np.ndarray | None,
        *,
        device: torch.device,
        vocab_size: int,
        shared: bool,
    ) -> PackedRow:
        """The row of ``input_ids`` ``[T]`` split by ``seq_lens`` ``[S]``; ``tokens`` ``[T]`` bool or None (all).
        ValueError for ids not 1-D integer or not < ``vocab_size``, bad lengths, or tokens not ``[T]``.
        """
        ids = host_array(input_ids, "input_ids")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError("input_ids must be a 1-D integer tensor [num_tokens] of packed token ids")
        ids = ids.astype(np.int64, copy=False)
        lens = check_seq_lens(host_array(seq_lens, "seq_lens"), len(ids))
        if len(ids) and not (ids.min() >= 0 and ids.max() < vocab_size):
            raise ValueError(f"input_ids must be token ids in [0, {vocab_size}), got {ids.min()}..{ids.max()}")
        wanted = np.ones(len(ids), bool)
        if tokens is not None:
            mask = host_array(tokens, "tokens")
            if mask.shape != ids.shape:
                raise ValueError(f"tokens must be a [T] mask like input_ids {ids.shape}, got {mask.shape}")
            wanted = mask.astype(bool)
        wanted[sample_starts(lens)] = False
        at = np.flatnonzero(wanted)
        plan = plan_shared_prefixes(ids, lens) if shared else None
        if plan is None:
            positions = np.arange(len(ids)) - np.repeat(sample_starts(lens), lens)
            decoder_ids, rows = to_device(ids, device), at - 1
            attention: dict = {"rlbus_seq_lens": SeqLens(lens.tolist())}
        else:
            positions = plan.position_ids
            rows = plan.expand.numpy()[at - 1]
            plan = plan.to(device)
            decoder_ids, attention = plan.row_ids, {"rlbus_shared_plan": plan}
        return cls(
            num_tokens=len(ids),
            lens=lens,
            at=to_device(at, device),
            hidden_rows=to_device(rows, device),
            targets=to_device(ids[at], device),
            decoder_ids=decoder_ids[None],
            position_ids=to_device(positions, device, torch.int64)[None],
            attention=attention,
        )

    @property
    def plan(self) -> SharedPrefixPlan | None:
        """The shared-prefix plan the row runs under, or None."""
        return self.attention.get("rlbus_shared_plan")


def check_seq_lens(seq_lens: np.ndarray, num_tokens: int) -> np.ndarray:
    """``seq_lens`` as int64: non-empty, 1-D, integer, >= 1, summing to ``num_tokens`` (else ValueError)."""
    lens = np.asarray(seq_lens)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError("seq_lens must be a non-empty 1-D tensor [num_samples] of sample lengths")
    if not np.issubdtype(lens.dtype, np.integer):
        raise ValueError(f"seq_lens must be an integer tensor, got {lens.dtype}; use .long()")
    lens = lens.astype(np.int64, copy=False)
    if (lens < 1).any():
        raise ValueError(f"seq_lens must all be >= 1, got {lens.tolist()}; drop empty samples before packing")
    if int(lens.sum()) != num_tokens:
        raise ValueError(f"seq_lens must sum to len(input_ids)={num_tokens} (the packed length), got {int(lens.sum())}")
    return lens
