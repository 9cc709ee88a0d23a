"""Padding-free packed forward of a Hugging Face causal LM: per-token logprobs of packed samples.

Several samples are concatenated into ONE row of T tokens (`input_ids [T]`, split by
`seq_lens [S]`), and the forward must give every sample exactly what an unpacked forward of that
sample alone would give. Two things make that true:
- position ids restart at 0 at each sample (`packed_position_ids`), so RoPE sees local positions;
- attention is block-diagonal and causal (`block_causal_mask`): a query attends only to keys of
  its own sample at positions <= its own.

Why an explicit mask (transformers 5.19, read from `masking_utils.py` and `modeling_qwen2.py`):
- `create_causal_mask` returns any 4-D `attention_mask` tensor unchanged (early exit in
  `_preprocess_mask_arguments`), and Qwen2's attention adds it to the scores: eager does
  `scores + mask` (so the mask MUST be additive float, a bool mask would be added as 0/1), sdpa
  passes it as `attn_mask` (float masks are added). Its dtype must be the model's compute dtype.
- transformers can infer packing from position ids alone (`find_packed_sequence_indices`), but
  only when `attention_mask is None and past_key_values is None`. Qwen2's forward creates a
  `DynamicCache` whenever `use_cache` is true (the config default, also in train mode), which
  silently disables that detection: sample 2.. then attend across samples (measured error ~0.5 in
  logits). We therefore pass the 4-D mask AND `use_cache=False`, and do not rely on detection.
- Passing a dict `{"full_attention": mask}` would skip mask creation too, but must then name every
  layer type the model uses; the 4-D tensor is simpler and also covers sliding-window layers
  (without applying the window: fine while samples are shorter than the window).
The mask costs O(T^2) memory (T = 8192 in float32: 256 MiB); the GPU path (flash-attention
varlen with cu_seqlens) is not implemented here, so only "sdpa" and "eager" are accepted.

Invariants: outputs are float32 `[T]`; `out[t]` depends only on tokens of t's own sample at
positions <= t; the first token of every sample gets logprob 0 (it has no context).
"""

from __future__ import annotations

import math

import torch

__all__ = ["block_causal_mask", "packed_position_ids", "packed_token_logprobs"]

SUPPORTED_ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


def block_causal_mask(seq_lens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive block-diagonal causal attention mask for one packed row.

    mask[0, 0, q, k] = 0                      if sample(q) == sample(k) and k <= q
                     = torch.finfo(dtype).min  otherwise
    (the finite minimum rather than -inf, as transformers uses, so no row can become NaN; every row
    keeps at least its diagonal.)

    Args:
        seq_lens: `[S]` integer tensor of sample lengths >= 1; T = seq_lens.sum().
        dtype: floating dtype of the mask; use the model's compute dtype (sdpa requires the mask
            dtype to match the query dtype).

    Returns:
        `[1, 1, T, T]` tensor of `dtype` on seq_lens' device.

    Raises:
        ValueError: seq_lens is not a non-empty 1-D integer tensor of values >= 1, or dtype is not
            a floating dtype.
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
    """Position ids that restart at 0 at each packed sample.

    Args:
        seq_lens: `[S]` integer tensor of sample lengths >= 1.

    Returns:
        `[1, T]` int64 on seq_lens' device, e.g. seq_lens [2, 1, 3] -> [[0, 1, 0, 0, 1, 2]].

    Raises:
        ValueError: seq_lens is not a non-empty 1-D integer tensor of values >= 1.
    """
    lens = validated_seq_lens(seq_lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(int(lens.sum()), device=lens.device)
    return (pos - torch.repeat_interleave(starts, lens))[None]


def packed_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logprob of each packed token given the earlier tokens of its own sample.

    out[t] = log softmax(logits[t-1] / temperature)[input_ids[t]]  if t is not a sample's first token
    out[t] = 0                                                      if it is (no context)
    where logits come from ONE forward over the packed row with `block_causal_mask` and
    `packed_position_ids`, cast to float32 before the division and log_softmax. Dividing by the
    sampling temperature gives the logprobs of the tempered sampling distribution; match what the
    inference engine reports.

    Args:
        model: a transformers causal LM (e.g. Qwen2ForCausalLM), possibly peft-wrapped, whose
            `config._attn_implementation` is "sdpa" or "eager".
        input_ids: `[T]` integer token ids of the packed samples, on the model's device.
        seq_lens: `[S]` integer lengths >= 1 of the packed samples, summing to T.
        temperature: finite float > 0 dividing the logits.

    Returns:
        `[T]` float32 logprobs (nats, <= 0), differentiable w.r.t. the model's parameters.

    Raises:
        ValueError: bad shapes/dtypes, seq_lens not summing to T, temperature not > 0, or an
            attention implementation other than sdpa/eager (a 4-D mask is not honoured there).
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 1 or input_ids.dtype.is_floating_point:
        raise ValueError("input_ids must be a 1-D integer tensor [num_tokens] of packed token ids")
    lens = validated_seq_lens(seq_lens).to(input_ids.device)
    if int(lens.sum()) != input_ids.numel():
        raise ValueError(f"seq_lens must sum to len(input_ids)={input_ids.numel()}, got {int(lens.sum())}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in SUPPORTED_ATTN_IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {impl!r} is not supported for packed forwards; load the model "
            f"with attn_implementation in {SUPPORTED_ATTN_IMPLEMENTATIONS}"
        )
    out = model(
        input_ids=input_ids[None].long(),
        attention_mask=block_causal_mask(lens, _compute_dtype(model)),
        position_ids=packed_position_ids(lens),
        use_cache=False,
    )
    logits = out.logits[0].float()
    if temperature != 1.0:
        logits = logits / temperature
    return _shifted_token_logprobs(logits, input_ids.long(), lens)


def _shifted_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """`[T, V]` float32 logits, `[T]` ids -> `[T]` logprob of ids[t] under logits[t-1], 0 at sample starts."""
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    next_token = logprobs.gather(1, input_ids[1:, None]).squeeze(1)
    shifted = torch.cat([next_token.new_zeros(1), next_token])
    is_first = torch.zeros_like(input_ids, dtype=torch.bool)
    is_first[torch.cumsum(lens, 0) - lens] = True
    return torch.where(is_first, 0.0, shifted)


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes attention scores in (that of its input embeddings)."""
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
    """`nn.Module` face of the packed forward, so a data-parallel wrapper (DDP) can own the call.

    Args:
        model: the policy (see `packed_token_logprobs`); registered as the submodule `model`.
        temperature: finite float > 0, the sampler's temperature.

    `forward(input_ids [T], seq_lens [S])` returns `(logprobs [T] float32 with grad, entropy [T]
    float32 detached)`: entropy of the tempered next-token distribution at each token's position
    (0 at sample starts), nats.
    """

    def __init__(self, model: torch.nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature

    def forward(self, input_ids: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = packed_token_logprobs(self.model, input_ids, seq_lens, temperature=self.temperature)
        return logprobs, torch.zeros_like(logprobs.detach())
