"""The CPU side of trainer/kernels/varlen_attention.py: `cu_seqlens`, when the CUDA kernel applies, and the
packed attention function's per-sample path in bfloat16 (what a CPU bf16 run uses).

The kernel itself runs only on CUDA (tests/gpu/test_gpu_varlen_attention.py, skipped here).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.forward.packed_attention import packed_sdpa_attention
from trainer.kernels.varlen_attention import (
    VarlenSignature,
    cu_seqlens,
    signature_of,
    varlen_causal_attention,
    varlen_decision,
    varlen_kernel_applies,
    varlen_signature,
)

LENS = [3, 1, 6, 2]


def test_cu_seqlens_are_int32_offsets():
    out = cu_seqlens(LENS, "cpu")
    assert out.dtype == torch.int32
    assert out.tolist() == [0, 3, 4, 10, 12]
    for bad in ([], [2, 0], [-1]):
        with pytest.raises(ValueError, match="lengths >= 1"):
            cu_seqlens(bad, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_never_applies_on_cpu(dtype):
    query = torch.zeros(1, 4, 12, 64, dtype=dtype)
    assert not varlen_kernel_applies(query, 0.0)


def test_direct_call_checks_lengths_before_the_kernel():
    q = torch.zeros(1, 4, 12, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="lens sum to 11, the packed row has 12 tokens"):
        varlen_causal_attention(q, q, q, [3, 1, 6, 1], None)


def test_bf16_packed_attention_on_cpu_is_per_sample_causal_sdpa():
    """bf16 on CPU takes the per-sample loop: each sample's output equals causal sdpa on that
    sample alone (same kernel, same bf16 inputs: bitwise), GQA heads repeated."""
    gen = torch.Generator().manual_seed(0)
    total = sum(LENS)
    q = torch.randn(1, 4, total, 16, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, 2, total, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    out, _ = packed_sdpa_attention(torch.nn.Module().eval(), q, k, v, None, rlbus_seq_lens=LENS)
    assert out.shape == (1, total, 4, 16) and out.dtype == torch.bfloat16
    start = 0
    for n in LENS:
        sl = slice(start, start + n)
        want = F.scaled_dot_product_attention(
            q[:, :, sl], k[:, :, sl].repeat_interleave(2, 1), v[:, :, sl].repeat_interleave(2, 1), is_causal=True
        )
        assert torch.equal(out[0, sl], want[0].transpose(0, 1))
        start += n


# --- the decision logic with the CUDA facts fed in (the kernel itself needs CUDA: tests/gpu) ---


def _varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None, scale=None):
    """The shape of torch 2.10's `varlen_attn` (an `is_causal` flag, no window, no GQA)."""


def _varlen_2_11(
    query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
):
    """The shape of torch 2.11's `varlen_attn` (a causal window, no `enable_gqa`: seen on the H200)."""


def _varlen_none(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k):
    """A `varlen_attn` with no causal argument at all: unusable for a decoder."""


def test_signature_detection_across_torch_versions():
    from torch.nn.attention.varlen import varlen_attn  # the installed torch (2.13 on the CPU image)

    assert signature_of(_varlen_2_10) == VarlenSignature(causal_arg="is_causal", gqa=False)
    assert signature_of(_varlen_2_11) == VarlenSignature(causal_arg="window_size", gqa=False)
    assert signature_of(_varlen_none) is None
    assert signature_of(varlen_attn) == VarlenSignature(causal_arg="window_size", gqa=True)
    assert varlen_signature() == signature_of(varlen_attn)


FACTS = dict(
    device_type="cuda",
    capability=(9, 0),
    dtype=torch.bfloat16,
    head_dim=64,
    dropout_p=0.0,
    signature=VarlenSignature(causal_arg="window_size", gqa=False),
)


@pytest.mark.parametrize(
    "change, applies",
    [
        ({}, True),
        ({"dtype": torch.float16}, True),
        ({"capability": (8, 0)}, True),
        ({"head_dim": 256}, True),
        ({"signature": VarlenSignature(causal_arg="is_causal", gqa=False)}, True),
        ({"device_type": "cpu", "capability": None}, False),
        ({"capability": (7, 5)}, False),  # Turing: no flash-attention 2
        ({"dtype": torch.float32}, False),  # no float32 flash path
        ({"head_dim": 60}, False),  # not a multiple of 8
        ({"head_dim": 512}, False),  # over the kernels' 256
        ({"dropout_p": 0.1}, False),  # the kernel has no dropout
        ({"signature": None}, False),  # torch without varlen_attn
    ],
)
def test_kernel_decision_from_cuda_facts(change, applies):
    assert varlen_decision(**{**FACTS, **change}) is applies


def test_kernel_applies_reads_the_cuda_facts(monkeypatch):
    """varlen_kernel_applies asks torch for the capability and signature: with those facts patched
    (a CPU tensor reporting is_cuda) it follows varlen_decision."""
    import trainer.kernels.varlen_attention as va

    class CudaLike(torch.Tensor):
        is_cuda = True

    q = torch.zeros(1, 4, 12, 64, dtype=torch.bfloat16).as_subclass(CudaLike)
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: seen.append(device) or (9, 0))
    monkeypatch.setattr(va, "varlen_decision", lambda **facts: facts)
    facts = varlen_kernel_applies(q, 0.0)
    assert seen and facts["capability"] == (9, 0) and facts["dtype"] == torch.bfloat16 and facts["head_dim"] == 64
    assert facts["signature"] == varlen_signature()


def test_attention_inputs_reach_the_kernel_in_the_autocast_dtype(monkeypatch):
    """Under a bfloat16 autocast, float32 q/k/v (what RoPE's float32 cos/sin give) are cast to
    bfloat16 before attention; the sdpa calls of the per-sample path receive bfloat16 and the
    output is bfloat16. Without autocast they stay float32."""
    import trainer.forward.packed_attention as pa

    seen: list[torch.dtype] = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, **kw)

    monkeypatch.setattr(pa.F, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(0)
    total = sum(LENS)
    q = torch.randn(1, 4, total, 16, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, 2, total, 16, generator=gen, requires_grad=True) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = packed_sdpa_attention(torch.nn.Module().eval(), q, k, v, None, rlbus_seq_lens=LENS)
    assert out.dtype == torch.bfloat16 and seen and all(d == (torch.bfloat16,) * 3 for d in seen)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and k.grad.dtype == torch.float32  # through the cast
    seen.clear()
    out, _ = packed_sdpa_attention(torch.nn.Module().eval(), q, k, v, None, rlbus_seq_lens=LENS)
    assert out.dtype == torch.float32 and all(d == (torch.float32,) * 3 for d in seen)
