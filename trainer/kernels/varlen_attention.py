"""Packed-row attention on CUDA: torch's flash-attention varlen kernel over `cu_seqlens`.

`trainer.forward.packed_attention` runs causal sdpa on each packed sample's slice, a Python loop of S
kernel launches per layer (the CPU reference). On CUDA, flash-attention's varlen kernel (Dao 2023,
"FlashAttention-2", arXiv:2307.08691, section 3.1; exposed by torch >= 2.10 as
`torch.nn.attention.varlen.varlen_attn`) does the same block-diagonal causal attention in ONE
launch per layer: the samples are rows `cu_seqlens[i]:cu_seqlens[i+1]` of `[total_tokens, heads,
head_dim]` tensors, and each query attends to keys of its own sample at positions <= its own.

When the kernel applies (`varlen_kernel_applies`): CUDA tensors in float16 or bfloat16 (the flash
kernels have no float32 path), head_dim a multiple of 8 and <= 256, compute capability >= 8.0
(Ampere and later: A100, H100, H200), no attention dropout (varlen_attn hardcodes dropout 0), and
a torch whose `varlen_attn` takes a causal argument: `window_size` (torch >= 2.11) or `is_causal`
(torch 2.10), read from its signature (`varlen_signature`), since a GPU vLLM build pins an older
torch than the CPU one. Otherwise the caller keeps the per-sample loop.

Invariants: same result as the per-sample causal sdpa loop to the kernel's rounding (tests/gpu:
bf16/fp16 forward and backward); grouped-query attention is passed to the kernel as is where
torch takes `enable_gqa` (2.13: flash-attention shares each kv head across its group of query
heads, no copy), else with the kv heads repeated (torch 2.10-2.12); `cu_seqlens` is int32 on the tensors' device, built once per packed
row (the last few rows' are cached: every layer of a forward reuses it; never written to).
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from trainer.kernels.transfer import to_device

__all__ = [
    "VARLEN_DTYPES",
    "VarlenSignature",
    "autocast_compute_dtype",
    "cu_seqlens",
    "repeat_kv",
    "signature_of",
    "to_compute_dtype",
    "varlen_attention",
    "varlen_causal_attention",
    "varlen_decision",
    "varlen_kernel_applies",
    "varlen_signature",
]

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
        `varlen_decision` of the query's facts and the installed torch's `varlen_signature`.
    """
    if not query.is_cuda:  # the capability query below needs a CUDA device
        return False
    return varlen_decision(
        device_type=query.device.type,
        capability=torch.cuda.get_device_capability(query.device),
        dtype=query.dtype,
        head_dim=query.shape[-1],
        dropout_p=dropout_p,
        signature=varlen_signature(),
    )


def varlen_decision(
    *,
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    head_dim: int,
    dropout_p: float,
    signature: VarlenSignature | None,
) -> bool:
    """The kernel decision from plain facts (pure: the CPU tests feed it CUDA facts).

    Args:
        device_type: "cuda", "cpu", ...; capability: the CUDA compute capability (major, minor), or
            None off CUDA; dtype: the query's dtype; head_dim: its last dimension; dropout_p: the
            attention dropout in effect; signature: the installed torch's `varlen_signature()`.

    Returns:
        True on CUDA with capability >= 8.0, float16/bfloat16, 8 | head_dim <= 256, no dropout and
        a `varlen_attn` with a causal argument.
    """
    return (
        device_type == "cuda"
        and capability is not None
        and tuple(capability) >= (8, 0)
        and dtype in VARLEN_DTYPES
        and head_dim % 8 == 0
        and 0 < head_dim <= MAX_HEAD_DIM
        and dropout_p == 0
        and signature is not None
    )


@dataclass(frozen=True)
class VarlenSignature:
    """What the installed torch's `torch.nn.attention.varlen.varlen_attn` accepts.

    Fields:
        causal_arg: "window_size" (torch >= 2.11: `window_size=(-1, 0)` is causal) or "is_causal"
            (torch 2.10: `is_causal=True`).
        gqa: True when it takes `enable_gqa` (torch >= 2.13); False: the caller repeats kv heads.
    """

    causal_arg: str
    gqa: bool


def signature_of(fn: Callable) -> VarlenSignature | None:
    """The `VarlenSignature` of a `varlen_attn`-like callable; None when it has no causal argument.

    Pure (reads `inspect.signature` only): the decision logic the CPU tests check against the
    signatures of torch 2.10, 2.11 and 2.13.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if "window_size" in params:
        causal = "window_size"
    elif "is_causal" in params:
        causal = "is_causal"
    else:
        return None
    return VarlenSignature(causal_arg=causal, gqa="enable_gqa" in params)


@functools.lru_cache(maxsize=1)
def varlen_signature() -> VarlenSignature | None:
    """`signature_of` the installed `varlen_attn`; None when torch has none (torch < 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return signature_of(varlen_attn)


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
    offsets = np.array([0, *itertools.accumulate(lens)], dtype=np.int32)
    return to_device(offsets, torch.device(device))  # queued, no host sync (trainer.kernels.transfer)


@functools.lru_cache(maxsize=4)
def _cached_cu_seqlens(lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`cu_seqlens` built once per packed row, not once per layer (one host -> device copy)."""
    return cu_seqlens(list(lens), device)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention of N segments in one flash-attention varlen call (CUDA).

    Segment i's queries are rows `cu_q[i]:cu_q[i+1]` of `query`, its keys/values rows
    `cu_k[i]:cu_k[i+1]` of `key`/`value`. With as many queries as keys it is plain causal
    attention; with fewer queries than keys the causal mask is aligned to the bottom-right corner
    (flash-attention >= 2.1's convention, Dao 2023): query j of a segment with Lq queries and Lk
    keys sees keys 0..Lk-Lq+j, i.e. its queries are the LAST Lq positions of the key sequence (a
    shared prefix's tails: keys = prefix + own tail).

    Args:
        query: `[Tq, heads, head_dim]`; key, value: `[Tk, kv_heads, head_dim]` (kv_heads divides
            heads), float16/bfloat16 on CUDA.
        cu_q, cu_k: `[N + 1]` int32 segment offsets on the tensors' device.
        max_q, max_k: the longest segment's queries / keys.
        scaling: softmax scale (None: 1/sqrt(head_dim)).

    Returns:
        `[Tq, heads, head_dim]`: softmax(q k^T * scale + causal) v per segment (Vaswani et al. 2017,
        eq. 1). Grouped-query attention goes to the kernel as is where the installed torch takes
        `enable_gqa`, else with the kv heads repeated (`repeat_interleave`, as sdpa expects).

    Raises:
        RuntimeError: the installed torch has no usable `varlen_attn` (check `varlen_kernel_applies`).
    """
    from torch.nn.attention.varlen import varlen_attn

    sig = varlen_signature()
    if sig is None:
        raise RuntimeError(f"torch {torch.__version__} has no varlen_attn with a causal argument")
    kwargs: dict = {"scale": scaling}
    if sig.causal_arg == "window_size":
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if sig.gqa and query.shape[1] != key.shape[1]:
        kwargs["enable_gqa"] = True
    else:
        key, value = repeat_kv(query, key, value)
    return varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, **kwargs)


def repeat_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """key, value with each kv head repeated to query's head count (grouped-query attention, as sdpa
    and kernels without `enable_gqa` expect); heads are dim 1 (`[1, heads, T, d]` or `[T, heads, d]`).
    Unchanged when the head counts already match."""
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    return key, value


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
        softmax(q k^T * scale + causal) v per sample (Vaswani et al. 2017, eq. 1), by
        `varlen_attention`.

    Raises:
        ValueError: the lengths do not sum to T (from `cu_seqlens` or here).
    """
    total = query.shape[2]
    if sum(lens) != total:
        raise ValueError(f"lens sum to {sum(lens)}, the packed row has {total} tokens")
    offsets = _cached_cu_seqlens(tuple(lens), query.device)
    longest = max(lens)
    # [1, H, T, D] -> [T, H, D]; a no-op copy when q/k/v are transposed views of the projections
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    return varlen_attention(q, k, v, offsets, offsets, longest, longest, scaling).unsqueeze(0)


def autocast_compute_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype in effect for `device`'s type (bfloat16 under `trainer.dtype: bfloat16`),
    or None when autocast is off there."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def to_compute_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q/k/v in the autocast compute dtype, as transformers' flash-attention integration casts them.

    Under a bfloat16 autocast with float32 parameters the query reaches attention as float32
    (the bfloat16 projection times RoPE's float32 cos/sin promotes), so neither the flash kernels
    (no float32 path) nor a bfloat16 sdpa would run. Casting here keeps attention in the compute
    dtype the precision policy chose (:mod:`trainer.forward.precision`); gradients flow back
    through the cast in float32. Without autocast, or already in that dtype, returns them as is.
    """
    dtype = autocast_compute_dtype(tensors[0].device)
    if dtype is None or dtype == tensors[0].dtype or not tensors[0].is_floating_point():
        return tensors
    return tuple(t.to(dtype) for t in tensors)
