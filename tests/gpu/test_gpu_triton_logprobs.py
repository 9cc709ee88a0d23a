"""The fused Triton logprob kernels (trainer/kernels/triton_logprobs.py) on CUDA against the torch path.

`linear_logprobs_and_entropy` with backend "triton" and backend "torch" on the same CUDA tensors
(T = 3000 rows: several chunks, the last one partial; V = 151936: Qwen's vocabulary, many
vocabulary tiles), forward (logprob, entropy) and backward (d hidden, d weight, d bias), with
float32 and bfloat16 weights. Both backends compute the chunk's logits with the same matmul and
differ only in the softmax/entropy/gradient reductions (float32 in both), so they agree to float32
rounding of sums over V terms: atol 1e-4 nats forward and 1e-4 relative to the largest gradient
element backward (8e-3 with bfloat16 weights, whose gradients are rounded to bf16: one unit in
the last place, 2^-7, may flip). "auto" must pick triton on CUDA (the packed forward's default).
"""

from __future__ import annotations

import pytest
import torch

from trainer.forward.logprobs import _resolve_backend, linear_logprobs_and_entropy

T, H, V = 3000, 128, 151936
CHUNK = 1024
TEMPERATURE = 0.7


def test_auto_backend_is_triton_on_cuda():
    pytest.importorskip("triton")
    assert _resolve_backend("auto", torch.device("cuda")) == "triton"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_torch_forward_and_backward(dtype):
    pytest.importorskip("triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden0 = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    weight0 = (torch.randn(V, H, device="cuda", generator=gen) * 0.05).to(dtype)
    bias0 = (torch.randn(V, device="cuda", generator=gen) * 0.1).to(dtype)
    targets = torch.randint(0, V, (T,), device="cuda", generator=gen)
    grad_lp = torch.randn(T, device="cuda", generator=gen)

    def run(backend):
        hidden, weight, bias = (t.clone().requires_grad_() for t in (hidden0, weight0, bias0))
        lp, ent = linear_logprobs_and_entropy(
            hidden, weight, bias, targets, temperature=TEMPERATURE, chunk_size=CHUNK, backend=backend
        )
        (lp * grad_lp).sum().backward()
        return lp.detach(), ent, [t.grad.float() for t in (hidden, weight, bias)]

    lp_t, ent_t, grads_t = run("triton")
    lp_r, ent_r, grads_r = run("torch")
    assert lp_t.dtype == ent_t.dtype == torch.float32
    assert (lp_t - lp_r).abs().max().item() < 1e-4
    assert (ent_t - ent_r).abs().max().item() < 1e-4
    grad_tol = 1e-4 if dtype == torch.float32 else 8e-3
    for name, g, r in zip(("hidden", "weight", "bias"), grads_t, grads_r):
        rel = (g - r).abs().max().item() / r.abs().max().item()
        assert rel < grad_tol, f"d{name}: triton off torch by {rel:.2e} relative"
