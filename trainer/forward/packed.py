"""Padding-free packed forward of a Hugging Face causal LM: per-token logprobs of packed samples.

Several samples are concatenated into ONE row of T tokens (`input_ids [T]`, split by
`seq_lens [S]`), and the forward must give every sample exactly what an unpacked forward of that
sample alone would give. Two things make that true:
- position ids restart at 0 at each sample (`packed_position_ids`), so RoPE sees local positions;
- attention is block-diagonal and causal: a query attends only to keys of its own sample at
  positions <= its own. `trainer.forward.packed_attention` runs causal sdpa on each sample's slice of the
  row (varlen attention: O(sum L_i^2), no `[T, T]` mask), switched on for the forward through
  transformers' `AttentionInterface`.

`use_cache=False` matters: Qwen2's forward otherwise creates a `DynamicCache` even in train mode.
`block_causal_mask` (the equivalent dense additive mask, O(T^2) memory) is kept as the reference
the tests compare the varlen path against. Only "sdpa" and "eager" models are accepted (the
implementation is switched for the packed forward and restored after).

Full-vocabulary logits are never materialized: the decoder body gives the last hidden states
`[T, H]`, and the LM head is applied chunk by chunk by `trainer.forward.logprobs` (forward AND backward),
which also yields the entropy of each next-token distribution. This needs the model's logits to be
exactly `lm_head(last hidden state)`: true for Qwen2/Llama-style models; configs that soft-cap or
rescale logits (`LOGIT_RESCALING_FIELDS`) are refused.

Precision: under a bfloat16 autocast context (`trainer.forward.precision`) the decoder body computes in
bfloat16, but its last hidden states are cast to the LM head weight's dtype (the float32 master
weight) and the head runs with autocast off, its matmuls in `head_dtype` (`trainer.lm_head_dtype`:
float32, TF32 or bfloat16) and its log-softmax in float32, so logprobs and entropy are float32
whatever the compute dtype.

Invariants: outputs are float32 `[T]`; `out[t]` depends only on tokens of t's own sample at
positions <= t; the first token of every sample gets logprob 0 and entropy 0 (it has no context).
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
    """Logprob of each packed token and entropy of the tempered next-token distribution before it.

    With h = the decoder's last hidden states of ONE forward over the packed row
    (`block_causal_mask`, `packed_position_ids`, `use_cache=False`) and z[t] = lm_head(h[t]).float()
    / temperature, for t not a sample's first token:
        logprobs[t] = log softmax(z[t-1])[input_ids[t]]
        entropy[t]  = -sum_v softmax(z[t-1])_v log softmax(z[t-1])_v          (nats)
    and logprobs[t] = entropy[t] = 0 at each sample's first token (no context). Dividing by the
    sampling temperature gives the tempered sampling distribution the inference engine reports.
    The LM head is applied `chunk_size` rows at a time (`trainer.forward.logprobs`), so no `[T, V]` logits
    tensor exists in the forward or the backward pass; the result equals the full-logits one to
    float32 rounding.

    Args:
        model: a transformers causal LM (e.g. Qwen2ForCausalLM), possibly peft-wrapped (LoRA on the
            decoder layers; not on lm_head), tied embeddings or not, whose
            `config._attn_implementation` is "sdpa" or "eager" and whose logits are exactly
            `lm_head(last hidden state)` (no soft-capping or logit scaling).
        input_ids: `[T]` integer token ids of the packed samples: a host numpy array or CPU tensor
            (nothing waits for the device: `trainer.forward.packed_row`), or a tensor on the
            model's device (read back once: a host sync).
        seq_lens: `[S]` integer lengths >= 1 of the packed samples, summing to T (host or device, as input_ids).
        temperature: finite float > 0 dividing the logits.
        chunk_size: rows of logits computed at a time, >= 1 (memory ~ chunk_size x V floats).
        share_prefixes: run the tokens that neighbouring samples share at their start (a group's
            prompt) through the decoder once (`trainer.forward.shared_prefix`); the same values up to float
            rounding, fewer decoder tokens. True, False or "auto" (`sharing_applies`).
        stats: if given, gets `"decoder_tokens"`: tokens the decoder ran (T, or fewer when shared).
        tokens: `[T]` bool (host or device, as input_ids), or None (every token): compute logprobs and entropy only at these
            tokens (the loss tokens; 0 elsewhere), so the LM head and the log-softmax skip the
            prompt rows the loss never reads.
        head_dtype: precision of the LM head's matmuls, "float32" | "tf32" | "bfloat16"
            (`trainer.lm_head_dtype`, `trainer.forward.logprobs.linear_logprobs_and_entropy`).

    Returns:
        `(logprobs, entropy)`, each `[T]` float32: logprobs (nats, <= 0) differentiable w.r.t. the
        model's parameters; entropy (nats, >= 0) detached.

    Raises:
        ValueError: bad shapes/dtypes (tokens not `[T]` included), seq_lens not summing to T, temperature not > 0, an attention
            implementation other than sdpa/eager (a 4-D mask is not honoured there), an LM head
            that is not a plain `nn.Linear`, or a config that rescales logits.
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
    """Logprob of each packed token given the earlier tokens of its own sample.

    The logprobs of `packed_logprobs_and_entropy` (same arguments, same formula):
    out[t] = log softmax(logits[t-1] / temperature)[input_ids[t]], and 0 at each sample's first token.

    Returns:
        `[T]` float32 logprobs (nats, <= 0), differentiable w.r.t. the model's parameters.

    Raises:
        ValueError: as `packed_logprobs_and_entropy`.
    """
    logprobs, _entropy = packed_logprobs_and_entropy(
        model, input_ids, seq_lens, temperature=temperature, chunk_size=chunk_size
    )
    return logprobs


def _validate_call(model: torch.nn.Module, input_ids, temperature) -> None:
    """Checks of the call besides the row's (`PackedRow.build`): input_ids' kind, temperature, attention."""
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
    """`[R, H]` last hidden states (after the final norm) at `row.hidden_rows`, from one packed
    forward of the decoder body over `row.decoder_ids`.

    `get_decoder()` is the transformers accessor of the body (Qwen2ForCausalLM -> `.model`); on a
    peft model the attribute lookup is forwarded to the wrapped transformers model, whose layers
    already hold the LoRA modules, so the adapters apply. With a shared-prefix plan the decoder
    runs on the compressed row of `trainer.forward.shared_prefix.plan_shared_prefixes` and
    `row.hidden_rows` already go through its expansion (`trainer.forward.packed_row`).
    `stats`, if given, gets the decoder's token count as `"decoder_tokens"`.
    """
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
    """Whether a packed row of `num_tokens` tokens on a `device_type` ("cpu", "cuda", ...) device
    runs its shared prefixes once (`trainer.share_prefixes`).

    True / False: as given. "auto", the measured rule (bench/README.md, "Shared-prefix speed" and
    the GPU trainer table): always on a CPU, where the decoder's FLOPs bound the step and sharing
    made it 1.5-2.9x faster; on CUDA only when num_tokens >= `SHARE_MIN_TOKENS_CUDA`: an H200 (0.5B shape,
    bf16, GRPO-shaped batch) took 1.14 s against 1.22 s unshared with 16384-token micro-batches and
    1.23 s against 1.05 s with 8192, where kernel launches rather than FLOPs bound a micro-batch and
    the shared path's gathers add launches.

    Raises:
        ValueError: a setting other than True, False or "auto".
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
        model: the policy (see `packed_logprobs_and_entropy`); registered as the submodule `model`.
        temperature: finite float > 0, the sampler's temperature.
        chunk_size: rows of logits computed at a time, >= 1.
        share_prefixes: run shared sample prefixes once: True, False or "auto" (`sharing_applies`).
        head_dtype: precision of the LM head's matmuls (`trainer.lm_head_dtype`).

    After each forward, `stats["decoder_tokens"]` is the number of tokens its decoder ran.

    `forward(input_ids [T], seq_lens [S], tokens [T] bool or None)` (host numpy arrays: nothing
    waits for the device, and a data-parallel wrapper, which moves tensor arguments only, leaves
    them alone; or tensors) returns `(logprobs [T] float32 with grad, entropy [T]
    float32 detached)`: entropy of the tempered next-token distribution at each token's position
    (0 at sample starts), nats. See `packed_logprobs_and_entropy`.

    Raises:
        ValueError: temperature not a finite number > 0 or chunk_size not an int >= 1.
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
