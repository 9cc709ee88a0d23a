"""Padding-free packed forward of a Hugging Face causal LM: per-token logprobs of packed samples.

Samples share one row (`input_ids [T]`, `seq_lens [S]`) and each gets what its unpacked forward
would: positions restart per sample and attention is block-diagonal causal
(`trainer.forward.packed_attention`; `block_causal_mask` is the dense reference). The LM head runs
chunked (`trainer.forward.logprobs`) on the last hidden states in float32, outside autocast; configs
that rescale logits are refused. A sample's first token gets logprob 0 and entropy 0.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from trainer.forward.logprobs import DEFAULT_CHUNK_SIZE, linear_logprobs_and_entropy
from trainer.forward.packed_attention import mask_placeholder, packed_attention
from trainer.forward.packed_row import PackedRow

__all__ = [
    "SHARE_MIN_TOKENS_CUDA",
    "PackedLogprobs",
    "block_causal_mask",
    "packed_logprobs_and_entropy",
    "packed_position_ids",
    "packed_token_logprobs",
    "sharing_applies",
]

SUPPORTED_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")

LOGIT_RESCALING_FIELDS = {"final_logit_softcapping": 0, "logit_scale": 1, "logits_scaling": 1}
"""Config fields (Gemma 2, Cohere, Granite) whose non-neutral value means logits != lm_head(hidden)."""


def block_causal_mask(seq_lens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[1, 1, T, T]` additive block-diagonal causal mask (0 or `finfo(dtype).min`) for `seq_lens` `[S]`;
    ValueError for lengths < 1, a non-integer or empty seq_lens, or a non-float dtype.
    """
    lens = validated_seq_lens(seq_lens)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype (the model's dtype), got {dtype!r}")
    ids = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    pos = torch.arange(ids.numel(), device=lens.device)
    allowed = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=lens.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def packed_position_ids(seq_lens: torch.Tensor) -> torch.Tensor:
    """`[1, T]` int64 positions restarting per sample ([2, 1, 3] -> [[0, 1, 0, 0, 1, 2]]); ValueError as
    `block_causal_mask`.
    """
    lens = validated_seq_lens(seq_lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum()), device=lens.device)
    return (pos - torch.repeat_interleave(starts, lens))[None]


def packed_logprobs_and_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor | np.ndarray,
    seq_lens: torch.Tensor | np.ndarray,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    share_prefixes: bool | str = False,
    stats: dict[str, float] | None = None,
    tokens: torch.Tensor | np.ndarray | None = None,
    head_dtype: str = "float32",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprobs, entropy)`, each `[T]` float32 nats: `log softmax(z[t-1])[input_ids[t]]` and its entropy,
    `z = lm_head(h).float() / temperature` (0 at each sample's first token); only logprobs has a gradient.

    model: transformers causal LM (peft allowed, not on lm_head), attention "sdpa" or "eager".
    input_ids `[T]`, seq_lens `[S]` (>= 1, summing to T), tokens `[T]` bool or None (only these are
    computed): host arrays (no host sync) or device tensors. share_prefixes: True, False or "auto"
    (`sharing_applies`). stats gets `"decoder_tokens"`. head_dtype: `trainer.lm_head_dtype`.

    Raises:
        ValueError: bad shapes or dtypes, seq_lens not summing to T, temperature not > 0, another
            attention implementation, an LM head not a plain `nn.Linear`, or rescaled logits.
    """
    _validate_call(model, input_ids, temperature)
    weight, bias = _output_projection(model)
    shared = sharing_applies(share_prefixes, weight.device.type, len(input_ids))
    row = PackedRow.build(input_ids, seq_lens, tokens, device=weight.device, vocab_size=weight.shape[0], shared=shared)
    # Under bfloat16 autocast (trainer.forward.precision) the body may return bfloat16 hidden states; the
    # head then runs with autocast off, its matmuls in head_dtype (trainer.forward.logprobs).
    hidden = _decoder_hidden_states(model, row, stats).to(weight.dtype)
    logprob, entropy = linear_logprobs_and_entropy(
        hidden,
        weight,
        bias,
        row.targets,
        temperature=temperature,
        chunk_size=chunk_size,
        head_dtype=head_dtype,
        checked_targets=True,
    )
    zeros = torch.zeros(row.num_tokens, dtype=logprob.dtype, device=logprob.device)
    return zeros.index_put((row.at,), logprob), zeros.index_put((row.at,), entropy)


def packed_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """`[T]` float32 logprobs of `packed_logprobs_and_entropy` (differentiable); raises as it does."""
    logprobs, _entropy = packed_logprobs_and_entropy(
        model, input_ids, seq_lens, temperature=temperature, chunk_size=chunk_size
    )
    return logprobs


def _validate_call(model: torch.nn.Module, input_ids, temperature) -> None:
    """Checks besides the row's (`PackedRow.build`): input_ids' kind, temperature, attention."""
    if not isinstance(input_ids, (torch.Tensor, np.ndarray)) or input_ids.ndim != 1:
        raise ValueError("input_ids must be a 1-D integer tensor [num_tokens] of packed token ids")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {impl!r} is not supported for packed forwards; load the model "
            f"with attn_implementation in {SUPPORTED_ATTN_IMPLEMENTATIONS}"
        )


def _decoder_hidden_states(
    model: torch.nn.Module, row: PackedRow, stats: dict[str, float] | None = None
) -> torch.Tensor:
    """`[R, H]` last hidden states at `row.hidden_rows` from one forward of the decoder body (LoRA applies)."""
    if stats is not None:
        stats["decoder_tokens"] = float(row.decoder_tokens)
    decoder = model.get_decoder()
    with packed_attention(model):
        out = decoder(
            input_ids=row.decoder_ids,
            attention_mask=mask_placeholder(row.decoder_ids.device, _compute_dtype(model)),
            position_ids=row.position_ids,
            use_cache=False,
            **row.attention,
        )
    # index_select, not hidden[idx]: its backward is index_add_, not a sorting index_put_ (shared_prefix)
    return out.last_hidden_state[0].index_select(0, row.hidden_rows)


SHARE_MIN_TOKENS_CUDA = 12288
"""`share_prefixes: auto` on CUDA shares only in micro-batches of at least this many tokens."""


def sharing_applies(setting: bool | str, device_type: str, num_tokens: int) -> bool:
    """Whether a row of `num_tokens` runs its shared prefixes once: "auto" is always on CPU, on CUDA from
    `SHARE_MIN_TOKENS_CUDA` tokens (measured: bench/README.md, "Shared-prefix speed"); ValueError otherwise.
    """
    if setting is True or setting is False:
        return setting
    if setting != "auto":
        raise ValueError(f"share_prefixes must be true, false or 'auto', got {setting!r}")
    return device_type != "cuda" or num_tokens >= SHARE_MIN_TOKENS_CUDA


def _output_projection(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight `[V, H]`, bias `[V]` or None) of the LM head; tied embeddings give the shared tensor."""
    config = model.config
    for name, neutral in LOGIT_RESCALING_FIELDS.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise ValueError(
                f"model config sets {name}={value!r}: its logits are not lm_head(hidden), which the chunked "
                "logprob path assumes; this model family is not supported"
            )
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"the output embedding is a {type(head).__name__}, not a plain torch.nn.Linear (LoRA or "
            "modules_to_save on lm_head?); keep lm_head out of the peft target_modules"
        )
    return head.weight, head.bias


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes attention scores in (its input embeddings')."""
    embeddings = model.get_input_embeddings()
    return embeddings.weight.dtype


def validated_seq_lens(seq_lens: torch.Tensor) -> torch.Tensor:
    """seq_lens as int64 after checking it is a non-empty 1-D integer tensor of values >= 1."""
    if not isinstance(seq_lens, torch.Tensor) or seq_lens.ndim != 1 or seq_lens.numel() == 0:
        raise ValueError("seq_lens must be a non-empty 1-D tensor [num_samples] of sample lengths")
    if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool or seq_lens.is_complex():
        raise ValueError(f"seq_lens must be an integer tensor, got {seq_lens.dtype}; use .long()")
    lens = seq_lens.to(torch.int64)
    if bool((lens < 1).any()):
        raise ValueError(f"seq_lens must all be >= 1, got {lens.tolist()}; drop empty samples before packing")
    return lens


class PackedLogprobs(torch.nn.Module):
    """`nn.Module` face of `packed_logprobs_and_entropy` for a data-parallel wrapper (DDP); `stats` holds the
    last forward's. ValueError for a temperature not > 0 or a chunk_size < 1.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        temperature: float = 1.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        share_prefixes: bool | str = False,
        head_dtype: str = "float32",
    ) -> None:
        super().__init__()
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if not (isinstance(chunk_size, int) and chunk_size >= 1):
            raise ValueError(f"chunk_size must be an int >= 1 (rows per chunk), got {chunk_size!r}")
        self.model = model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.share_prefixes = share_prefixes
        self.head_dtype = head_dtype
        self.stats: dict[str, float] = {}

    def forward(
        self,
        input_ids: torch.Tensor | np.ndarray,
        seq_lens: torch.Tensor | np.ndarray,
        tokens: torch.Tensor | np.ndarray | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return packed_logprobs_and_entropy(
            self.model,
            input_ids,
            seq_lens,
            temperature=self.temperature,
            chunk_size=self.chunk_size,
            share_prefixes=self.share_prefixes,
            stats=self.stats,
            tokens=tokens,
            head_dtype=self.head_dtype,
        )
