"""The comparison the GPU kernel tests share: a half-precision kernel against a float32 reference,
forward and backward, no worse than the same computation done the plain way in half precision.

Tolerances (the docstrings of tests/gpu/test_gpu_varlen_attention.py and test_gpu_shared_prefix.py):
the half-precision kernels round q k^T, the softmax and p v to 8 (bf16) or 11 (fp16) mantissa bits,
so an output element of magnitude ~1 may be off by a few units of the last place: atol 2e-2 (bf16) and
3e-3 (fp16) on outputs, and the same relative to the largest gradient element on dq, dk, dv; and the
kernel at most twice as far from the float32 reference as the plain half-precision path.
"""

from __future__ import annotations

import torch

ATOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3}


def forward_backward(fn, q, k, v, weight):
    """(`fn(q, k, v)` as float32, [dq, dk, dv] float32) of the loss sum(out * weight); grads reset."""
    out = fn(q, k, v)
    (out.float() * weight).sum().backward()
    grads = [t.grad.float() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach().float(), grads


def assert_kernel_close(kernel, half, reference, q, k, v, weight, atol: float, what: str) -> None:
    """Assert `kernel` (forward and backward) is within `atol` of `reference` and no more than twice
    as far from it as `half`, the plain half-precision path; `what` names the kernel in messages."""
    got, got_grads = forward_backward(kernel, q, k, v, weight)
    plain, plain_grads = forward_backward(half, q, k, v, weight)
    ref, ref_grads = forward_backward(reference, q, k, v, weight)
    err = (got - ref).abs().max().item()
    assert err < atol, f"{what} off the float32 reference by {err:.2e} (atol {atol})"
    assert err <= 2 * (plain - ref).abs().max().item() + 1e-6, f"{what} worse than the plain half-precision path"
    for name, g, h, r in zip("qkv", got_grads, plain_grads, ref_grads):
        scale = r.abs().max().item()
        g_err = (g - r).abs().max().item() / scale
        assert g_err < atol, f"d{name}: {what} off the float32 reference by {g_err:.2e} relative (atol {atol})"
        assert g_err <= 2 * (h - r).abs().max().item() / scale + 1e-6, f"d{name}: {what} worse than the plain path"
