"""Packed-row attention on CUDA: torch's flash-attention varlen kernel over `cu_seqlens`.

`trainer.forward.packed_attention` runs causal sdpa on each packed sample's slice, a Python loop of S
kernel launches per layer (the CPU reference). On CUDA, flash-attention's varlen kernel (Dao 2023,
"FlashAttention-2", arXiv:2307.08691, section 3.1; exposed by torch 2.13 as
`torch.nn.attention.varlen.varlen_attn`) does the same block-diagonal causal attention in ONE
launch per layer: the samples are rows `cu_seqlens[i]:cu_seqlens[i+1]` of `[total_tokens, heads,
head_dim]` tensors, and each query attends to keys of its own sample at positions <= its own.

When the kernel applies (`varlen_kernel_applies`): CUDA tensors in float16 or bfloat16 (the flash
kernels have no float32 path), head_dim a multiple of 8 and <= 256, compute capability >= 8.0
(Ampere and later: A100, H100, H200), no attention dropout (varlen_attn hardcodes dropout 0), and
`torch.nn.attention.varlen` importable. Otherwise the caller keeps the per-sample loop.

Invariants: same result as the per-sample causal sdpa loop to the kernel's rounding (tests/gpu:
bf16/fp16 forward and backward); grouped-query attention is passed to the kernel as is
(`enable_gqa=True`: flash-attention shares each kv head across its group of query heads, no
`repeat_interleave` copy); `cu_seqlens` is int32 on the tensors' device, built once per packed
row (the last few rows' are cached: every layer of a forward reuses it; never written to).
"""

from __future__ import annotations

import functools
import itertools

import torch

__all__ = ["VARLEN_DTYPES", "cu_seqlens", "varlen_causal_attention", "varlen_kernel_applies"]

VARLEN_DTYPES = (torch.float16, torch.bfloat16)
"""Dtypes the flash-attention varlen kernel computes in."""

MAX_HEAD_DIM = 256
"""Largest head dimension of the flash-attention kernels."""


def varlen_kernel_applies(query: torch.Tensor, dropout_p: float) -> bool:
    """Whether `varlen_causal_attention` can run on `query` (see the module docstring).

    Args:
        query: `[1, heads, T, head_dim]` query of a packed row.
        dropout_p: the attention dropout probability in effect (0 at eval; the kernel has none).

    Returns:
        True on CUDA (capability >= 8.0) in float16/bfloat16 with 8 | head_dim <= 256, no dropout.
    """
    if not query.is_cuda or query.dtype not in VARLEN_DTYPES or dropout_p > 0:
        return False
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return False
    if torch.cuda.get_device_capability(query.device) < (8, 0):
        return False
    try:
        from torch.nn.attention import varlen  # noqa: F401 - torch >= 2.10
    except ImportError:
        return False
    return True


def cu_seqlens(lens: list[int], device: torch.device | str) -> torch.Tensor:
    """Cumulative sample offsets of a packed row, as flash-attention's varlen kernels take them.

    Args:
        lens: S sample lengths, each int >= 1.
        device: where the kernel runs.

    Returns:
        `[S + 1]` int32: `[0, lens[0], lens[0] + lens[1], ..., sum(lens)]`.

    Raises:
        ValueError: no lengths, or a length < 1.
    """
    if not lens or min(lens) < 1:
        raise ValueError(f"lens must be a non-empty list of sample lengths >= 1, got {lens!r}")
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=4)
def _cached_cu_seqlens(lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`cu_seqlens` built once per packed row, not once per layer (one host -> device copy)."""
    return cu_seqlens(list(lens), device)


def varlen_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: list[int], scaling: float | None
) -> torch.Tensor:
    """Causal attention within each packed sample in one flash-attention varlen call (CUDA).

    Args:
        query: `[1, heads, T, head_dim]`; key, value: `[1, kv_heads, T, head_dim]` (kv_heads divides
            heads), float16/bfloat16 on CUDA (`varlen_kernel_applies`).
        lens: the packed sample lengths (ints >= 1 summing to T).
        scaling: softmax scale (None: 1/sqrt(head_dim)).

    Returns:
        `[1, T, heads, head_dim]` (the layout transformers' attention functions return):
        softmax(q k^T * scale + causal) v per sample (Vaswani et al. 2017, eq. 1).

    Raises:
        ValueError: the lengths do not sum to T (from `cu_seqlens` or here).
    """
    from torch.nn.attention.varlen import varlen_attn

    total = query.shape[2]
    if sum(lens) != total:
        raise ValueError(f"lens sum to {sum(lens)}, the packed row has {total} tokens")
    offsets = _cached_cu_seqlens(tuple(lens), query.device)
    longest = max(lens)
    # [1, H, T, D] -> [T, H, D]; a no-op copy when q/k/v are transposed views of the projections
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    out = varlen_attn(
        q, k, v, offsets, offsets, longest, longest,
        scale=scaling, window_size=(-1, 0), enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.unsqueeze(0)
