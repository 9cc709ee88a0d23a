"""Triton kernels of the chunked logprob path (`trainer.forward.logprobs`), one program per logits row.

`chunk_logprob_entropy` streams the row once, keeping the running max m, `s = sum exp(z - m)` and
`w = sum exp(z - m) z` (online softmax, Milakov & Gimelshein 2018, arXiv:1805.02867, algorithm 3,
plus w): `lse = m + log s`, `entropy = lse - w / s`. `chunk_grad_logits` writes the gradient over the
logits in place, as Liger Kernel does (arXiv:2410.10989). `z = float32(logits) / temperature`.
Importing needs triton; the kernels take CPU tensors under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chunk_grad_logits", "chunk_logprob_entropy"]

MAX_BLOCK_V = 4096
"""Vocabulary tile per loop iteration (a power of two; 4096 float32 = 16 KiB of registers/SRAM per row)."""


@triton.jit
def _logprob_entropy_kernel(
    logits_ptr,
    targets_ptr,
    logprob_ptr,
    entropy_ptr,
    lse_ptr,
    row_stride,
    vocab_size,
    temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    running_max = tl.full((), float("-inf"), tl.float32)
    sum_exp = tl.zeros((), tl.float32)
    sum_exp_z = tl.zeros((), tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        in_vocab = offsets < vocab_size
        z = tl.load(row_ptr + offsets, mask=in_vocab, other=float("-inf")).to(tl.float32) / temperature
        new_max = tl.maximum(running_max, tl.max(z, 0))
        rescale = tl.exp(running_max - new_max)
        weights = tl.where(in_vocab, tl.exp(z - new_max), 0.0)
        sum_exp = sum_exp * rescale + tl.sum(weights, 0)
        sum_exp_z = sum_exp_z * rescale + tl.sum(weights * tl.where(in_vocab, z, 0.0), 0)  # no 0 * -inf
        running_max = new_max
    lse = running_max + tl.log(sum_exp)
    target = tl.load(targets_ptr + row)
    target_z = tl.load(row_ptr + target).to(tl.float32) / temperature
    tl.store(logprob_ptr + row, target_z - lse)
    tl.store(entropy_ptr + row, lse - sum_exp_z / sum_exp)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _grad_logits_kernel(
    logits_ptr,
    targets_ptr,
    lse_ptr,
    grad_ptr,
    row_stride,
    vocab_size,
    temperature,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    lse = tl.load(lse_ptr + row)
    grad = tl.load(grad_ptr + row)
    target = tl.load(targets_ptr + row)
    for start in range(0, vocab_size, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        in_vocab = offsets < vocab_size
        raw = tl.load(row_ptr + offsets, mask=in_vocab, other=0.0)
        z = raw.to(tl.float32) / temperature
        grad_z = grad * (tl.where(offsets == target, 1.0, 0.0) - tl.exp(z - lse))
        tl.store(row_ptr + offsets, (grad_z / temperature).to(raw.dtype), mask=in_vocab)


def chunk_logprob_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `trainer.forward.logprobs.chunk_logprob_entropy`: `(logprob, entropy, lse)` `[N]`
    float32 of `logits` `[N, V]` (not modified) at `targets` `[N]` int64.
    """
    logits = _rows_contiguous(logits)
    num_rows, vocab_size = logits.shape
    logprob = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logprob)
    lse = torch.empty_like(logprob)
    if num_rows:
        _logprob_entropy_kernel[(num_rows,)](
            logits,
            targets.contiguous(),
            logprob,
            entropy,
            lse,
            logits.stride(0),
            vocab_size,
            float(temperature),
            BLOCK_V=_block_v(vocab_size),
        )
    return logprob, entropy, lse


def chunk_grad_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_logprob: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Triton twin of `trainer.forward.logprobs.chunk_grad_logits`: the `[N, V]` gradient of the raw logits,
    written over `logits` (same storage and dtype).
    """
    logits = _rows_contiguous(logits)
    num_rows, vocab_size = logits.shape
    if num_rows:
        _grad_logits_kernel[(num_rows,)](
            logits,
            targets.contiguous(),
            lse.contiguous(),
            grad_logprob.float().contiguous(),
            logits.stride(0),
            vocab_size,
            float(temperature),
            BLOCK_V=_block_v(vocab_size),
        )
    return logits


def _block_v(vocab_size: int) -> int:
    return min(MAX_BLOCK_V, triton.next_power_of_2(vocab_size))


def _rows_contiguous(logits: torch.Tensor) -> torch.Tensor:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [num_rows, vocab_size], got shape {tuple(logits.shape)}")
    return logits if logits.stride(-1) == 1 else logits.contiguous()
