"""Varlen attention for packed rows: causal sdpa on each sample's slice, registered with transformers.

A packed row holds several samples back to back (`trainer.forward.packed`). A dense block-causal `[T, T]`
mask makes attention cost O(T^2) in the row length and has to be built and read; on the 2-core CPU
machine it took 14-38% of the forward FLOPs at budgets 1024-4096 and lost the packed path most of
its advantage over padding (`bench/README.md`, packed vs padded). Running causal
`scaled_dot_product_attention` on each sample's slice costs O(sum_i L_i^2) and needs no mask:
exactly what flash-attention's varlen kernel (`cu_seqlens`) does on GPU, in plain torch. On CUDA in
float16/bfloat16 that kernel itself runs instead, one launch per layer for the whole row
(`trainer.kernels.varlen_attention`); the per-sample loop stays the reference it is tested against
(tests/gpu/test_gpu_varlen_attention.py) and the path everywhere else (CPU, float32, dropout).

How it plugs in (transformers 5.19, `modeling_utils.AttentionInterface`): the function below is
registered under `PACKED_ATTENTION`; `packed_attention(model)` switches the model to it for one
forward (`set_attn_implementation`) and back. The decoder is called with the sample lengths as the
extra keyword `rlbus_seq_lens` (a `SeqLens`), which transformers forwards to every attention call, and with a 4-D
placeholder `attention_mask` so that no mask is built (a 4-D mask is passed through unchanged).

Invariants: the output for a token depends only on the tokens of its own sample at positions <= its
own (the same as the unpacked forward); grouped-query attention repeats key/value heads as sdpa
expects; called without `rlbus_seq_lens` (e.g. by `generate`) it is plain sdpa with the given mask.
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
    """The sample lengths of a packed row, as the decoder passes them to `packed_sdpa_attention`
    (keyword `rlbus_seq_lens`).

    An opaque holder, not a list: the keyword goes through each decoder layer, and a layer compiled
    by ``trainer.compile`` guards on a list's length, so every new number of samples in a
    micro-batch recompiled the layers (after 8, torch runs them eagerly). An object of this class
    is passed through unguarded (tests/trainer/test_compile.py).

    Args:
        lens: S ints >= 1 (the packed sample lengths, in packing order).
    """

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
    """Causal attention within each packed sample (transformers' attention-function contract).

    Args:
        module: the attention layer (its `training` flag gates dropout).
        query: `[1, heads, T, head_dim]`; key, value: `[1, kv_heads, T, head_dim]` (kv_heads
            divides heads: grouped-query attention).
        attention_mask: ignored when `rlbus_seq_lens` is given (the slices ARE the block-diagonal
            structure); otherwise passed to plain sdpa.
        scaling: softmax scale (None: 1/sqrt(head_dim)). dropout: attention dropout probability.
        kwargs: `rlbus_seq_lens`: a `SeqLens` (or a list) of ints >= 1 summing to T (the packed
            sample lengths); or
            `rlbus_shared_plan`: a `trainer.forward.shared_prefix.SharedPrefixPlan` of the compressed row
            (T = its compressed tokens), whose segments then replace the samples.

    Returns:
        (`[1, T, heads, head_dim]` attention output, None): softmax(q k^T * scale + causal) v per
        sample (Vaswani et al. 2017, eq. 1), concatenated in packing order, in the autocast
        compute dtype when autocast is on (q/k/v are cast to it first: `to_compute_dtype`). Computed by the
        flash-attention varlen kernel where `varlen_kernel_applies` (CUDA, fp16/bf16, no dropout),
        else by causal sdpa on each sample's slice; with a shared-prefix plan by
        `trainer.forward.shared_prefix.segment_attention`.

    Raises:
        ValueError: the lengths do not sum to T.
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
    """A 4-D `attention_mask` (`[1, 1, 1, 1]` zeros of `dtype` on `device`) that transformers passes
    through without building a `[T, T]` mask. Made on the device once per (device, dtype): a copy of a
    host tensor per forward would be a blocking host-to-device copy, one host sync per micro-batch
    (what tests/gpu/test_gpu_host_sync.py saw on an H200)."""
    return torch.zeros(1, 1, 1, 1, device=device, dtype=dtype)


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` (a transformers `PreTrainedModel`, or a peft model around one) with
    `packed_sdpa_attention` inside the block, restoring its attention implementation after."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    previous = base.config._attn_implementation
    base.set_attn_implementation(PACKED_ATTENTION)
    try:
        yield
    finally:
        base.set_attn_implementation(previous)
