"""Memory-lean token logprobs and entropy from hidden states: the output projection chunk by chunk.

The naive path computes `logits = hidden @ weight.T` for all T positions at once, a `[T, V]`
float32 tensor (T = 8192, V = 151936: 5 GiB), and autograd keeps the log-softmax of it for the
backward pass. Here the T rows are cut into chunks of `chunk_size` rows:
- forward: per chunk, logits -> (logprob of the target, entropy, logsumexp); only the `[T]`
  outputs and the `[T]` logsumexp are kept, the chunk's logits are freed;
- backward: per chunk, the logits are recomputed, turned into the gradient of the logits
  (`(onehot(target) - softmax) * grad / temperature`), and multiplied into `grad_hidden` (rows of
  the chunk) and `grad_weight` (accumulated over chunks in float32).
So the extra memory is O(chunk_size * V) in both passes instead of O(T * V). This is the chunked
"fused linear cross-entropy" of Liger Kernel (Hsu et al. 2024, arXiv:2410.10989, section 3.2) and
the recompute idea of Cut Cross-Entropy (Wijmans et al. 2024, arXiv:2411.09009), for logprobs
(not a mean loss) and with the entropy alongside.

The per-chunk step (`logits -> logprob, entropy, logsumexp` and `logits -> grad of logits`) has two
backends: plain torch (`chunk_logprob_entropy`, `chunk_grad_logits`, any device) and the fused
Triton kernels of `trainer.kernels.triton_logprobs` (one read of the logits per pass; used on CUDA when
triton imports). Both give the naive result to float32 rounding (tests: 1e-5).

Precision of the head (`head_dtype`, `trainer.lm_head_dtype`): the matmuls run in float32 by
default, or in TF32 / bfloat16 when chosen; the log-softmax, the entropy and the outputs are
float32 whatever the choice (bench/README.md has the measured speed and sampler mismatch of each).

Invariants: outputs are float32 `[T]` (float64 for a float64 model: exact tests such as the
micro-batch invariance run in float64); logits are computed in the head's dtype and cast to
float32 (or kept in float64) BEFORE the division by the temperature (as the naive path `logits.float() / temperature`);
the entropy output carries no gradient; no tensor of T * V elements is ever allocated when
`chunk_size < T`.
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
    """Raw logits of one chunk: `z = hidden @ weight.T + bias`, in the weight's dtype.

    Args:
        hidden: `[N, H]` hidden states (final-norm output of the decoder) of N positions.
        weight: `[V, H]` output embedding (the LM head).
        bias: `[V]` or None.

    Returns:
        `[N, V]` logits in weight.dtype (a fresh buffer the caller may overwrite in place).
    """
    return torch.nn.functional.linear(hidden, weight, bias)


def chunk_logprob_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-softmax gathered at the targets, entropy and logsumexp of tempered logits (torch backend).

    With z = logits.float() / temperature (OVERWRITES `logits` in place when it is float32):
        lse[n]      = log sum_v exp(z[n, v])
        logprob[n]  = z[n, targets[n]] - lse[n]                       (log-softmax, gathered)
        entropy[n]  = lse[n] - sum_v softmax(z[n])_v * z[n, v]       (= -sum_v p log p, nats)
    The entropy form follows from log p_v = z_v - lse and sum_v p_v = 1 (Shannon entropy of the
    tempered next-token distribution).

    Args:
        logits: `[N, V]` raw logits (any float dtype).
        targets: `[N]` int64 target ids in [0, V).
        temperature: finite float > 0.

    Returns:
        `(logprob, entropy, lse)`, each `[N]` float32.
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
    """Gradient of sum_n grad_logprob[n] * logprob[n] w.r.t. the RAW logits (torch backend).

        d logprob[n] / d z[n, v] = onehot(targets[n])_v - softmax(z[n])_v      (log-softmax derivative)
        d z / d logits = 1 / temperature
    so grad_logits[n, v] = grad_logprob[n] * (onehot - exp(z[n, v] - lse[n])) / temperature.

    Args:
        logits: `[N, V]` raw logits (recomputed; OVERWRITTEN in place when float32).
        targets: `[N]` int64 target ids.
        lse: `[N]` float32 logsumexp of the tempered logits (from the forward).
        grad_logprob: `[N]` float32 incoming gradient.
        temperature: finite float > 0.

    Returns:
        `[N, V]` gradient in logits.dtype (ready for the matmuls with hidden and weight).
    """
    z = _tempered_float32(logits, temperature)
    grad = z.sub_(lse[:, None]).exp_().mul_(-grad_logprob[:, None])  # -g * softmax
    grad.scatter_add_(1, targets[:, None], grad_logprob[:, None])  # + g * onehot
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(logits.dtype)


def _tempered_float32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature in at least float32 (float64 stays float64), in place when logits is
    already in that dtype (a buffer we own)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return z.div_(temperature) if temperature != 1.0 else z


class ChunkedLinearLogprobs(torch.autograd.Function):
    """Autograd op `(hidden [T, H], weight [V, H], bias [V] | None, targets [T]) -> (logprob [T], entropy [T])`.

    Forward and backward both loop over chunks of `chunk_size` rows (see the module docstring);
    saved for backward: hidden, weight, bias, targets and the `[T]` float32 logsumexp. Autocast is
    disabled inside (the matmuls run in the inputs' dtype, so the recomputed logits equal the
    forward's). Gradients
    flow to hidden, weight and bias (only those that require grad); `grad_weight` and `grad_bias`
    are accumulated in float32 and cast to the parameter dtype at the end. Entropy is marked
    non-differentiable. Call it through `linear_logprobs_and_entropy`, which validates inputs.
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
    """(hidden, weight, bias) in the dtype the LM head's matmuls run in.

    "bfloat16": float32 operands cast to bfloat16 once per pass (the logits come out bfloat16 and
    are cast to float32 before the log-softmax); "float32"/"tf32": unchanged (tf32 is a matmul
    mode, `head_matmul_precision`). Float64 (the exact tests) and already-narrow operands stay as
    they are.
    """
    if head_dtype != "bfloat16" or weight.dtype != torch.float32:
        return hidden, weight, bias
    narrow = torch.bfloat16
    return hidden.to(narrow), weight.to(narrow), None if bias is None else bias.to(narrow)


def head_matmul_precision(head_dtype: str, device: torch.device):
    """Context: float32 matmuls on CUDA in TF32 (10-bit mantissa inputs, float32 accumulation) for
    "tf32", restoring the previous setting after; a no-op otherwise and on CPU (no TF32 there)."""
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
    """Autocast off: the backward recomputes the logits, which must be bit-identical to the forward's,
    and autocast state is not restored in backward; the matmuls run in the inputs' own dtype."""
    return torch.autocast(device_type=device.type, enabled=False)


def _accumulate_float32(acc: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """acc += left @ right, with acc float32 or float64 (in place, no temporary when the operands
    have acc's dtype)."""
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
    """Logprob of each target and entropy of the tempered distribution, without `[T, V]` logits.

        z[t]       = (hidden[t] @ weight.T + bias).float() / temperature
        logprob[t] = log softmax(z[t])[targets[t]]
        entropy[t] = -sum_v softmax(z[t])_v log softmax(z[t])_v

    Args:
        hidden: `[T, H]` float hidden states (row t predicts targets[t]); T may be 0.
        weight: `[V, H]` output embedding, same dtype and device as hidden.
        bias: `[V]` output bias or None.
        targets: `[T]` integer target ids in [0, V).
        checked_targets: the caller has checked the ids are in [0, V) on the host
            (`trainer.forward.packed_row`): skip the check here, which reads the device's
            min/max back (a host sync).
        temperature: finite float > 0 (the sampler's temperature).
        chunk_size: rows per chunk, >= 1; peak extra memory ~ a few x chunk_size x V x 4 bytes.
        backend: "torch", "triton" (kernels of `trainer.kernels.triton_logprobs`; CUDA, or CPU under
            TRITON_INTERPRET=1), or "auto" (triton on CUDA when it imports, torch otherwise).
        head_dtype: precision of the head's matmuls (`HEAD_DTYPES`, `trainer.lm_head_dtype`):
            "float32", "tf32" (CUDA TF32 matmuls; float32 on CPU) or "bfloat16" (operands cast to
            bfloat16, logits cast to float32 before the log-softmax, weight gradient accumulated
            in float32). The log-softmax, entropy and outputs are float32 in every case.

    Returns:
        `(logprob, entropy)`: `[T]` float32; logprob (nats, <= 0) differentiable w.r.t. hidden,
        weight and bias; entropy (nats, in [0, log V]) detached.

    Raises:
        ValueError: bad shapes, dtypes, devices, target ids out of range, temperature not > 0,
            chunk_size < 1, or an unknown backend; "triton" when triton cannot be imported.
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
