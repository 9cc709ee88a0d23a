"""Packed-row attention on CUDA: torch's flash-attention varlen kernel over `cu_seqlens`.

FlashAttention-2's varlen kernel (Dao 2023, arXiv:2307.08691, section 3.1; torch >= 2.10's
`torch.nn.attention.varlen.varlen_attn`) runs a packed row's block-diagonal causal attention in one
launch per layer. It applies on CUDA with capability >= 8.0, fp16/bf16, 8 | head_dim <= 256, no
dropout, and a `varlen_attn` whose signature has a causal argument (torch 2.10-2.13 differ).
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
    """Whether `varlen_causal_attention` runs on `query` `[1, heads, T, head_dim]` (`varlen_decision`)."""
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
    """The kernel decision from plain facts (pure: the CPU tests feed it CUDA facts)."""
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
    """What `varlen_attn` takes: `causal_arg` ("window_size" or "is_causal"); `gqa`: `enable_gqa`."""

    causal_arg: str
    gqa: bool


def signature_of(fn: Callable) -> VarlenSignature | None:
    """The `VarlenSignature` of a `varlen_attn`-like callable; None without a causal argument."""
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
    """`[S + 1]` int32 offsets `[0, l0, l0 + l1, ..., sum]` of `lens` on `device`; ValueError for no lengths
    or one < 1.
    """
    if not lens or min(lens) < 1:
        raise ValueError(f"lens must be a non-empty list of sample lengths >= 1, got {lens!r}")
    offsets = np.array([0, *itertools.accumulate(lens)], dtype=np.int32)
    return to_device(offsets, torch.device(device))  # queued, no host sync (trainer.kernels.transfer)


@functools.lru_cache(maxsize=4)
def _cached_cu_seqlens(lens: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """`cu_seqlens` once per packed row, not once per layer."""
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
    """`[Tq, heads, head_dim]` causal attention of N segments in one flash varlen call (CUDA, fp16/bf16).

    Segment i: queries `cu_q[i]:cu_q[i+1]`, keys `cu_k[i]:cu_k[i+1]` (`[N + 1]` int32); key, value
    `[Tk, kv_heads, head_dim]`. With fewer queries than keys the causal mask is aligned bottom-right
    (flash-attention >= 2.1). RuntimeError when torch has no usable `varlen_attn`.
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
    """key, value with each kv head repeated to query's head count (heads on dim 1)."""
    repeats = query.shape[1] // key.shape[1]
    if repeats > 1:
        key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    return key, value


def varlen_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lens: list[int], scaling: float | None
) -> torch.Tensor:
    """`[1, T, heads, head_dim]` causal attention within each packed sample (`lens` summing to T) of query
    `[1, heads, T, head_dim]` in one `varlen_attention` call; ValueError when the lengths do not sum to T.
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
    """The autocast dtype in effect for `device`'s type, or None when autocast is off."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def to_compute_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q/k/v in the autocast compute dtype, as transformers' flash-attention integration casts them: under
    bfloat16 autocast, RoPE's float32 tables promote the query to float32, which keeps flash off.
    """
    dtype = autocast_compute_dtype(tensors[0].device)
    if dtype is None or dtype == tensors[0].dtype or not tensors[0].is_floating_point():
        return tensors
    return tuple(t.to(dtype) for t in tensors)
