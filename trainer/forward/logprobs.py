"""Token logprobs and entropy from hidden states without a `[T, V]` logits tensor.

The LM head runs over chunks of `chunk_size` rows; the forward keeps the `[T]` outputs and
logsumexp, the backward recomputes each chunk's logits: O(chunk_size * V) extra memory. This is
Liger Kernel's chunked fused linear cross-entropy (arXiv:2410.10989, section 3.2) with Cut
Cross-Entropy's recompute (arXiv:2411.09009). The per-chunk step runs in torch or in the Triton
kernels of `trainer.kernels.triton_logprobs` (CUDA). Outputs are float32 (float64 for a float64 model).
"""

from __future__ import annotations

import contextlib
import importlib
import math

import torch

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "HEAD_DTYPES",
    "ChunkedLinearLogprobs",
    "chunk_grad_logits",
    "chunk_logprob_entropy",
    "linear_logprobs_and_entropy",
]

DEFAULT_CHUNK_SIZE = 1024
"""Rows per chunk: 1024 x V=151936 float32 logits is 0.6 GiB, small next to a policy's activations."""

BACKENDS = ("auto", "torch", "triton")


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`[N, V]` logits `hidden [N, H] @ weight [V, H].T + bias` in the weight's dtype (a fresh buffer)."""
    return torch.nn.functional.linear(hidden, weight, bias)


def chunk_logprob_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(logprob, entropy, lse)` `[N]` float32 of `z = logits [N, V] / temperature` at `targets` `[N]` (torch
    backend; overwrites float32 `logits`): `logprob = z[target] - lse`, `entropy = lse - sum_v softmax(z)_v z_v`.
    """
    z = _tempered_float32(logits, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logprob = z.gather(1, targets[:, None]).squeeze(1) - lse
    probs = torch.softmax(z, dim=-1)
    expected_z = torch.bmm(probs[:, None, :], z[:, :, None]).reshape(-1)  # sum_v p_v z_v, no [N, V] temp
    return logprob, lse - expected_z, lse


def chunk_grad_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_logprob: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """`[N, V]` gradient of `sum_n grad_logprob[n] * logprob[n]` w.r.t. the raw logits (torch backend):
    `grad_logprob * (onehot(target) - exp(z - lse)) / temperature` in `logits.dtype`; overwrites float32 `logits`.
    """
    z = _tempered_float32(logits, temperature)
    grad = z.sub_(lse[:, None]).exp_().mul_(-grad_logprob[:, None])  # -g * softmax
    grad.scatter_add_(1, targets[:, None], grad_logprob[:, None])  # + g * onehot
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(logits.dtype)


def _tempered_float32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits / temperature` in at least float32, in place when already that dtype."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return z.div_(temperature) if temperature != 1.0 else z


class ChunkedLinearLogprobs(torch.autograd.Function):
    """Autograd op `(hidden [T, H], weight [V, H], bias [V] | None, targets [T]) -> (logprob [T], entropy [T])`,
    autocast off so the backward's recomputed logits equal the forward's; use `linear_logprobs_and_entropy`.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, backend, head_dtype="float32"):
        ops = _chunk_ops(backend)
        num_rows = hidden.shape[0]
        logprob = hidden.new_empty(num_rows, dtype=torch.promote_types(hidden.dtype, torch.float32))
        entropy = torch.empty_like(logprob)
        lse = torch.empty_like(logprob)
        with _no_autocast(hidden.device), head_matmul_precision(head_dtype, hidden.device):
            h, w, b = head_operands(hidden, weight, bias, head_dtype)
            for start in range(0, num_rows, chunk_size):
                rows = slice(start, start + chunk_size)
                logits = chunk_logits(h[rows], w, b)
                logprob[rows], entropy[rows], lse[rows] = ops[0](logits, targets[rows], temperature)
                del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.backend, ctx.head_dtype = temperature, chunk_size, backend, head_dtype
        ctx.mark_non_differentiable(entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)  # float32, or float64 for a float64 model
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=acc_dtype, device=weight.device) if need_bias else None
        ops = _chunk_ops(ctx.backend)
        grad_logprob = grad_logprob.to(lse.dtype)
        with _no_autocast(hidden.device), head_matmul_precision(ctx.head_dtype, hidden.device):
            h, w, b = head_operands(hidden, weight, bias, ctx.head_dtype)
            for start in range(0, hidden.shape[0], ctx.chunk_size):
                rows = slice(start, start + ctx.chunk_size)
                logits = chunk_logits(h[rows], w, b)
                grad_logits = ops[1](logits, targets[rows], lse[rows], grad_logprob[rows], ctx.temperature)
                del logits
                if need_hidden:
                    if grad_hidden.dtype == grad_logits.dtype:
                        torch.mm(grad_logits, w, out=grad_hidden[rows])
                    else:
                        grad_hidden[rows] = torch.mm(grad_logits, w)
                if need_weight:
                    _accumulate_float32(grad_weight, grad_logits.t(), h[rows])
                if need_bias:
                    grad_bias += grad_logits.sum(0, dtype=acc_dtype)
                del grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


HEAD_DTYPES = ("float32", "tf32", "bfloat16")
"""`trainer.lm_head_dtype` values: the precision of the LM head's matmuls (logits and their gradients)."""


def head_operands(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, head_dtype: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(hidden, weight, bias) cast to bfloat16 for "bfloat16" when float32; otherwise unchanged."""
    if head_dtype != "bfloat16" or weight.dtype != torch.float32:
        return hidden, weight, bias
    narrow = torch.bfloat16
    return hidden.to(narrow), weight.to(narrow), None if bias is None else bias.to(narrow)


def head_matmul_precision(head_dtype: str, device: torch.device):
    """Context: float32 matmuls in TF32 on CUDA for "tf32"; a no-op otherwise."""
    if head_dtype != "tf32" or device.type != "cuda":
        return contextlib.nullcontext()
    return _allow_tf32()


@contextlib.contextmanager
def _allow_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


def _no_autocast(device: torch.device):
    """Autocast off, so the backward's recomputed logits are bit-identical to the forward's."""
    return torch.autocast(device_type=device.type, enabled=False)


def _accumulate_float32(acc: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """`acc += left @ right` in acc's dtype (float32 or float64)."""
    if left.dtype == acc.dtype:
        acc.addmm_(left, right)
    else:
        acc += torch.mm(left, right).to(acc.dtype)


def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: str = "auto",
    head_dtype: str = "float32",
    checked_targets: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(logprob, entropy)`, each `[T]` float32 nats, of `softmax((hidden @ weight.T + bias) / temperature)`.

    hidden `[T, H]` (row t predicts `targets[t]`), weight `[V, H]` of the same dtype and device, bias
    `[V]` or None, targets `[T]` integer ids in [0, V) (`checked_targets=True` skips the check, a host
    sync). backend: "torch", "triton" or "auto"; head_dtype: one of `HEAD_DTYPES`. Only logprob has a gradient.

    Raises:
        ValueError: bad shapes, dtypes, devices, ids, temperature (not > 0), chunk_size (< 1), backend
            or head_dtype; "triton" when triton does not import.
    """
    _validate(hidden, weight, bias, targets, temperature, chunk_size, backend, checked_targets)
    if head_dtype not in HEAD_DTYPES:
        raise ValueError(f"head_dtype must be one of {HEAD_DTYPES}, got {head_dtype!r}")
    resolved = _resolve_backend(backend, hidden.device)
    return ChunkedLinearLogprobs.apply(
        hidden, weight, bias, targets.long(), float(temperature), int(chunk_size), resolved, head_dtype
    )


def _validate(hidden, weight, bias, targets, temperature, chunk_size, backend, checked_targets=False) -> None:
    if not (isinstance(hidden, torch.Tensor) and hidden.ndim == 2 and hidden.dtype.is_floating_point):
        raise ValueError("hidden must be a 2-D float tensor [num_tokens, hidden_size]")
    if not (isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.shape[1] == hidden.shape[1]):
        raise ValueError(
            f"weight must be [vocab_size, hidden_size={hidden.shape[1]}], got "
            f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"hidden ({hidden.dtype}, {hidden.device}) and weight ({weight.dtype}, {weight.device}) must share "
            "dtype and device; cast the hidden states to the LM head's dtype"
        )
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(f"bias must be [vocab_size={weight.shape[0]}] of {weight.dtype}, got {tuple(bias.shape)}")
    if not isinstance(targets, torch.Tensor) or targets.shape != hidden.shape[:1] or targets.dtype.is_floating_point:
        raise ValueError(f"targets must be an integer tensor [num_tokens={hidden.shape[0]}]")
    if (
        not checked_targets
        and targets.numel()
        and not (0 <= int(targets.min()) and int(targets.max()) < weight.shape[0])
    ):
        raise ValueError(
            f"targets must be token ids in [0, {weight.shape[0]}), got {int(targets.min())}..{int(targets.max())}"
        )
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not (isinstance(chunk_size, int) and chunk_size >= 1):
        raise ValueError(f"chunk_size must be an int >= 1 (rows per chunk), got {chunk_size!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def _resolve_backend(backend: str, device: torch.device) -> str:
    """Backend "auto" -> "triton" on CUDA when triton imports, else "torch"; "triton" must import."""
    if backend == "torch" or (backend == "auto" and device.type != "cuda"):
        return "torch"
    try:
        importlib.import_module("trainer.kernels.triton_logprobs")  # imports triton
    except ImportError as error:
        if backend == "auto":
            return "torch"
        raise ValueError(f"backend 'triton' needs the triton package ({error}); use backend='torch'") from error
    return "triton"


def _chunk_ops(backend: str):
    """(forward op, backward op) of the per-chunk step for a resolved backend."""
    if backend == "triton":
        from trainer.kernels import triton_logprobs

        return triton_logprobs.chunk_logprob_entropy, triton_logprobs.chunk_grad_logits
    return chunk_logprob_entropy, chunk_grad_logits
