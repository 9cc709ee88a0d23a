"""Varlen attention for packed rows: causal sdpa on each sample's slice, registered with transformers.

Per-sample causal sdpa costs O(sum_i L_i^2) and needs no `[T, T]` mask: flash-attention's varlen
(`cu_seqlens`) in plain torch, the tested reference of `trainer.kernels.varlen_attention`, which
runs instead on CUDA in fp16/bf16. `packed_attention(model)` switches the model to `PACKED_ATTENTION`
(transformers' `AttentionInterface`); the decoder passes the lengths as `rlbus_seq_lens` and a 4-D
placeholder mask. Without `rlbus_seq_lens` it is plain sdpa.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trainer.forward.shared_prefix import segment_attention
from trainer.kernels.varlen_attention import repeat_kv, to_compute_dtype, varlen_causal_attention, varlen_kernel_applies

__all__ = ["PACKED_ATTENTION", "packed_attention", "packed_sdpa_attention", "mask_placeholder", "SeqLens"]

PACKED_ATTENTION = "rlbus_packed_sdpa"
"""The name the varlen function is registered under in transformers' `AttentionInterface`."""


class SeqLens:
    """The S sample lengths (keyword `rlbus_seq_lens`), opaque: ``trainer.compile`` would guard on a list's length."""

    __slots__ = ("lens",)

    def __init__(self, lens) -> None:
        self.lens = [int(n) for n in lens]


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """(`[1, T, heads, head_dim]`, None): causal attention within each sample (Vaswani et al. 2017, eq. 1).

    query `[1, heads, T, head_dim]`, key/value `[1, kv_heads, T, head_dim]`; kwargs `rlbus_seq_lens`
    (lengths summing to T) or `rlbus_shared_plan` (`SharedPrefixPlan`). Flash varlen kernel where
    `varlen_kernel_applies`, else sdpa per slice; ValueError when the lengths do not sum to T.
    """
    lens = kwargs.pop("rlbus_seq_lens", None)
    if isinstance(lens, SeqLens):
        lens = lens.lens
    plan = kwargs.pop("rlbus_shared_plan", None)
    dropout_p = dropout if module.training else 0.0
    if lens is not None or plan is not None:
        query, key, value = to_compute_dtype(query, key, value)
    if plan is not None:  # grouped-query kv heads as they are: segment_attention gathers them first
        return segment_attention(query, key, value, plan, scaling, dropout_p), None
    if lens is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if sum(lens) != query.shape[2]:
        raise ValueError(f"rlbus_seq_lens sum to {sum(lens)}, the packed row has {query.shape[2]} tokens")
    if varlen_kernel_applies(query, dropout_p):
        return varlen_causal_attention(query, key, value, list(lens), scaling), None
    key, value = repeat_kv(query, key, value)
    outs = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout_p)
        for q, k, v in zip(query.split(lens, 2), key.split(lens, 2), value.split(lens, 2))
    ]
    return torch.cat(outs, 2).transpose(1, 2).contiguous(), None


# outside any compiled graph (trainer.compile, trainer/forward/compiled.py): the lengths and the
# shared-prefix plan change with every micro-batch
AttentionInterface.register(PACKED_ATTENTION, torch.compiler.disable(packed_sdpa_attention))


@functools.lru_cache(maxsize=8)
def mask_placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`[1, 1, 1, 1]` zeros, a 4-D mask transformers passes through; cached, as a per-forward copy syncs the host."""
    return torch.zeros(1, 1, 1, 1, device=device, dtype=dtype)


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module) -> Iterator[None]:
    """Context: `model` (transformers or peft) runs `packed_sdpa_attention`, its implementation restored after."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    previous = base.config._attn_implementation
    base.set_attn_implementation(PACKED_ATTENTION)
    try:
        yield
    finally:
        base.set_attn_implementation(previous)
