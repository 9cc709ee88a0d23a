"""The CPU side of trainer/kernels/varlen_attention.py: `cu_seqlens`, when the CUDA kernel applies, and the
packed attention function's per-sample path in bfloat16 (what a CPU bf16 run uses).

The kernel itself runs only on CUDA (tests/gpu/test_gpu_varlen_attention.py, skipped here).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.forward.packed_attention import packed_sdpa_attention
from trainer.kernels.varlen_attention import cu_seqlens, varlen_causal_attention, varlen_kernel_applies

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
        want = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl].repeat_interleave(2, 1),
                                              v[:, :, sl].repeat_interleave(2, 1), is_causal=True)
        assert torch.equal(out[0, sl], want[0].transpose(0, 1))
        start += n
