"""Flash-attention varlen on CUDA (trainer/kernels/varlen_attention.py) against the per-sample sdpa loop.

Both run on the same packed row (mixed sample lengths, one of length 1, grouped-query attention
8 query heads / 2 kv heads, head_dim 64) in bfloat16 and float16; the reference is the per-sample
causal sdpa loop of trainer/forward/packed_attention.py run in float32 on the same (rounded) inputs.
Tolerances: the half-precision kernels round q k^T, the softmax and p v to 8 (bf16) or 11 (fp16)
mantissa bits, so each output element may be off by a few units of the last place of a value of
magnitude ~1: atol 2e-2 (bf16) and 3e-3 (fp16) on outputs, and the same relative to the largest
gradient element on dq, dk, dv. The kernel must also be at least as close to the float32
reference as the half-precision loop is, times 2 (neither is exact; the kernel must not be worse).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.kernel_compare import ATOL, assert_kernel_close
from trainer.forward.packed_attention import packed_sdpa_attention
from trainer.kernels.varlen_attention import (
    varlen_causal_attention,
    varlen_kernel_applies,
)

LENS = [5, 17, 1, 40, 9]
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def loop_reference(query, key, value, lens):
    """`[1, T, H, D]` per-sample causal sdpa (the CPU path), kv heads repeated for GQA."""
    repeats = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    outs = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        for q, k, v in zip(query.split(lens, 2), key.split(lens, 2), value.split(lens, 2))
    ]
    return torch.cat(outs, 2).transpose(1, 2)


def inputs(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENS)

    def rand(heads):
        return torch.randn(1, heads, total, HEAD_DIM, device="cuda", generator=gen).to(dtype).requires_grad_()

    return rand(HEADS), rand(KV_HEADS), rand(KV_HEADS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_varlen_matches_per_sample_loop_forward_and_backward(dtype):
    q, k, v = inputs(dtype)
    assert varlen_kernel_applies(q, 0.0), f"varlen kernel not applicable on {torch.cuda.get_device_name()}"
    weight = torch.randn(1, sum(LENS), HEADS, HEAD_DIM, device="cuda")
    module = torch.nn.Module().eval()

    def kernel(q, k, v):
        out, _ = packed_sdpa_attention(module, q, k, v, None, rlbus_seq_lens=LENS)
        return out

    def loop_half(q, k, v):
        return loop_reference(q, k, v, LENS)

    def loop_fp32(q, k, v):
        return loop_reference(q.float(), k.float(), v.float(), LENS)

    assert_kernel_close(kernel, loop_half, loop_fp32, q, k, v, weight, ATOL[dtype], "varlen")


def test_varlen_direct_call_shape_and_float32_fallback():
    q, k, v = inputs(torch.bfloat16)
    out = varlen_causal_attention(q, k, v, LENS, None)
    assert out.shape == (1, sum(LENS), HEADS, HEAD_DIM) and out.dtype == torch.bfloat16
    # float32 or dropout: the kernel does not apply, the packed function keeps the loop
    assert not varlen_kernel_applies(q.float(), 0.0)
    assert not varlen_kernel_applies(q, 0.1)
    with pytest.raises(ValueError, match="sum to"):
        varlen_causal_attention(q, k, v, LENS[:-1], None)


def test_packed_model_forward_bf16_matches_unpacked(tmp_path):
    """Tiny Qwen2 in bfloat16 on CUDA: each packed token's logprob (varlen kernel + Triton
    logprobs) equals the logprob from the sample's own unpacked forward (sdpa, full logits) to
    bf16 rounding of the logits (0.05 nats)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.forward.packed import packed_token_logprobs

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=300,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 300, (n,), generator=gen) for n in LENS]
    ids = torch.cat(samples).cuda()
    with torch.no_grad():
        packed = packed_token_logprobs(model, ids, torch.tensor(LENS, device="cuda"))
        assert packed.dtype == torch.float32
        for start, sample in zip([0, *torch.tensor(LENS).cumsum(0).tolist()], samples):
            logits = model(sample[None].cuda()).logits[0].float()
            want = torch.log_softmax(logits[:-1], -1).gather(1, sample[1:, None].cuda())[:, 0]
            got = packed[start + 1 : start + len(sample)]
            assert packed[start].item() == 0.0
            if len(sample) > 1:
                assert (got - want).abs().max().item() < 0.05
