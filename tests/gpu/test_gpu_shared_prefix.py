"""Shared-prefix forward on CUDA (trainer/forward/shared_prefix.py): the flash varlen path and the padded path.

- Attention alone: the flat segments of a GRPO-shaped plan (prefixes, and tails whose queries are
  the last rows of their keys: bottom-right causal) through flash-attention's varlen kernel
  (`varlen_attention`), against the same layout through the sdpa loop (`varlen_attention_reference`)
  in float32 on the same rounded inputs; grouped-query attention 8 query heads / 2 kv heads,
  head_dim 64, bfloat16 and float16. Tolerances as tests/gpu/test_gpu_varlen_attention.py: atol
  2e-2 (bf16) / 3e-3 (fp16) on outputs and on gradients relative to their largest entry, and the
  kernel no worse than twice the half-precision padded sdpa path's error against float32.
- The whole packed forward and backward of a float32 Qwen2 under bfloat16 autocast
  (`trainer.dtype: bfloat16`): shared prefixes on (one varlen call per layer, checked) and off give
  the same logprobs and gradients to bfloat16 rounding: no further apart than the unshared
  bfloat16 forward is from float32, and the shared one no more than twice as far from float32.
- The same model in float32 on CUDA (padded sdpa path, `index_select` gathers): on and off agree
  to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.gpu.kernel_compare import ATOL, assert_kernel_close
from tests.trainer.test_shared_prefix import varlen_attention_reference
from trainer.forward import shared_prefix
from trainer.forward.packed import packed_logprobs_and_entropy
from trainer.forward.precision import PrecisionPolicy
from trainer.forward.shared_prefix import (
    flat_segment_attention,
    padded_segment_attention,
    plan_shared_prefixes,
)
from trainer.kernels.varlen_attention import varlen_attention, varlen_kernel_applies

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
VOCAB = 300


def grpo_row(seed: int = 0, num_prompts: int = 3, group: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (4 template tokens in common, 20-60 tokens) x `group` completions of 1-80 tokens,
    starting mid-group (the first group's last 2 samples)."""
    rng = np.random.default_rng(seed)
    template = rng.integers(0, VOCAB, 4).tolist()
    samples = []
    for _ in range(num_prompts):
        prompt = template + rng.integers(0, VOCAB, int(rng.integers(16, 57))).tolist()
        samples += [prompt + rng.integers(0, VOCAB, int(rng.integers(1, 81))).tolist() for _ in range(group)]
    samples = samples[group - 2 :]
    return torch.tensor(sum(samples, [])), torch.tensor([len(s) for s in samples])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_flat_segments_through_the_kernel_match_the_reference(dtype):
    plan = plan_shared_prefixes(*grpo_row()).to("cuda")
    t_c = len(plan.row_ids)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(heads):  # [1, heads, T_c, d] as a transposed projection, as the model passes it
        return (
            torch.randn(1, t_c, heads, HEAD_DIM, device="cuda", generator=gen)
            .to(dtype)
            .transpose(1, 2)
            .requires_grad_()
        )

    q, k, v = rand(HEADS), rand(KV_HEADS), rand(KV_HEADS)
    assert varlen_kernel_applies(q, 0.0), f"varlen kernel not applicable on {torch.cuda.get_device_name()}"
    weight = torch.randn(1, t_c, HEADS, HEAD_DIM, device="cuda", generator=gen)

    def kernel(q, k, v):
        return flat_segment_attention(q, k, v, plan.segments, None, varlen_attention)

    def padded_half(q, k, v):
        return padded_segment_attention(q, k, v, plan.padded, None, 0.0)

    def reference_fp32(q, k, v):
        return flat_segment_attention(q.float(), k.float(), v.float(), plan.segments, None, varlen_attention_reference)

    assert_kernel_close(kernel, padded_half, reference_fp32, q, k, v, weight, ATOL[dtype], "varlen segments")


def tiny_qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(cfg).cuda().train()


def logprobs_and_grads(model, input_ids, seq_lens, share: bool, dtype: torch.dtype):
    model.zero_grad()
    with PrecisionPolicy(dtype).autocast("cuda"):
        logprobs, _entropy = packed_logprobs_and_entropy(model, input_ids, seq_lens, share_prefixes=share)
    weights = torch.linspace(-1, 1, len(logprobs), device="cuda")
    (weights * logprobs).sum().backward()
    grads = torch.cat([p.grad.flatten() for _n, p in sorted(model.named_parameters())]).double()
    return logprobs.detach(), grads


def test_bf16_shared_prefix_forward_and_backward_match_unshared(monkeypatch):
    calls: list[int] = []

    def counted(query, key, value, cu_q, *args):
        calls.append(len(cu_q) - 1)
        return varlen_attention(query, key, value, cu_q, *args)

    monkeypatch.setattr(shared_prefix, "varlen_attention", counted)
    model = tiny_qwen2()
    input_ids, seq_lens = (t.cuda() for t in grpo_row(seed=1))
    off, off_grads = logprobs_and_grads(model, input_ids, seq_lens, False, torch.bfloat16)
    on, on_grads = logprobs_and_grads(model, input_ids, seq_lens, True, torch.bfloat16)
    exact, exact_grads = logprobs_and_grads(model, input_ids, seq_lens, False, torch.float32)
    assert calls == [3 + len(seq_lens)] * 2, calls  # one kernel call per layer: 3 prefixes + every tail
    on_err, off_err = (on - exact).abs().max().item(), (off - exact).abs().max().item()
    assert (on - off).abs().max().item() <= off_err, (on_err, off_err)
    assert on_err <= 2 * off_err, (on_err, off_err)

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    assert rel(on_grads, off_grads) <= rel(off_grads, exact_grads)
    assert rel(on_grads, exact_grads) <= 2 * rel(off_grads, exact_grads)


def test_float32_shared_prefix_on_cuda_takes_the_padded_path(monkeypatch):
    monkeypatch.setattr(shared_prefix, "varlen_attention", None)  # float32: the kernel must not be called
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = tiny_qwen2()
    input_ids, seq_lens = (t.cuda() for t in grpo_row(seed=2))
    off, off_grads = logprobs_and_grads(model, input_ids, seq_lens, False, torch.float32)
    on, on_grads = logprobs_and_grads(model, input_ids, seq_lens, True, torch.float32)
    torch.testing.assert_close(on, off, rtol=0, atol=2e-5)
    assert ((on_grads - off_grads).norm() / off_grads.norm()).item() < 1e-5
