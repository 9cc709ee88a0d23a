"""Tests for trainer.forward.shared_prefix: the shared-prefix forward gives the unshared forward's numbers.

Rows are built like GRPO micro-batches: groups of completions of one prompt, adjacent, plus the
awkward cases (a micro-batch starting mid-group, two identical completions, a completion that is a
prefix of another, one-token samples). Every comparison is against the plain packed forward
(`trainer.forward.packed`, itself tested against unpacked forwards), for logprobs, entropy and every
parameter's gradient. The models are float64, but Qwen's RMSNorm computes in float32 whatever the
input dtype, so both paths agree to float32 rounding of the gradients (~1e-7 relative), not float64's:
`_assert_grads_close` allows 1e-6 of each gradient's largest entry.

The GRPO-shaped tests run float32 models (and bfloat16 autocast) on a micro-batch of several
prompts x several completions of varied lengths that starts mid-group, through both attention
layouts: the padded sdpa batches (CPU) and the flat varlen segments that the CUDA flash kernel runs
(`flat_segment_attention`), here with a loop of sdpa calls (`varlen_attention_reference`) standing
in for the kernel (tests/gpu/test_gpu_shared_prefix.py runs the kernel itself).
"""

import numpy as np
import peft
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trainer.forward import shared_prefix
from trainer.forward.packed import PackedLogprobs, packed_logprobs_and_entropy
from trainer.forward.precision import PrecisionPolicy
from trainer.forward.shared_prefix import flat_segment_attention, padded_segment_attention, plan_shared_prefixes

VOCAB = 300


def _tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    return model.to(torch.float64).train()


def _groups_row(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples: the tail of one group (2), a group of 4 (one duplicate completion, one completion
    that is a prefix of another), a lone sample, a one-token sample, a group of 3."""
    rng = np.random.default_rng(seed)
    prompt_a, prompt_b, prompt_c = (rng.integers(0, VOCAB, n).tolist() for n in (6, 9, 4))
    prompt_b[:3] = prompt_a[:3]  # two prompts sharing a template-like start
    comp = [rng.integers(0, VOCAB, n).tolist() for n in (5, 3, 7, 7)]
    samples = [
        prompt_a + comp[0],
        prompt_a + comp[1],
        prompt_b + comp[2],
        prompt_b + comp[2],
        prompt_b + comp[2][:3],
        prompt_b + comp[3],
        rng.integers(0, VOCAB, 8).tolist(),
        [int(rng.integers(0, VOCAB))],
        prompt_c + comp[0],
        prompt_c + comp[1],
        prompt_c + comp[3],
    ]
    return torch.tensor(sum(samples, [])), torch.tensor([len(s) for s in samples])


def _assert_grads_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        scale = float(grad.abs().max())
        torch.testing.assert_close(actual[name], grad, rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_plan_keeps_whole_groups_and_maps_every_token_to_itself():
    input_ids, seq_lens = _groups_row()
    plan = plan_shared_prefixes(input_ids, seq_lens)
    assert plan is not None
    # every original token reads a compressed row with its own token id and its own position
    positions = torch.cat([torch.arange(int(n)) for n in seq_lens])
    assert torch.equal(plan.row_ids[plan.expand], input_ids)
    assert torch.equal(plan.position_ids[plan.expand], positions)
    # prompt_a (6) once for 2, prompt_b + 3 shared completion tokens (12) once for 3 then 9 for the
    # 4th would save less than the whole group at 9: 3 * 9; prompt_c (4) once for 3
    assert plan.saved_tokens == 6 + 3 * 9 + 2 * 4
    assert len(plan.row_ids) == len(input_ids) - plan.saved_tokens
    _assert_segments_are_samples(plan)


def _assert_segments_are_samples(plan) -> None:
    """The flat segments tile the compressed row; each segment's keys are its sample's positions
    0..Lk-1 with its queries the last Lq of them; the padded batches hold every row exactly once."""
    seg, t_c = plan.segments, len(plan.row_ids)
    assert seg.cu_q.dtype == seg.cu_k.dtype == torch.int32 and int(seg.cu_q[-1]) == t_c
    assert int(seg.cu_k[-1]) == len(seg.key_rows)
    for q0, q1, k0, k1 in zip(
        seg.cu_q[:-1].tolist(), seg.cu_q[1:].tolist(), seg.cu_k[:-1].tolist(), seg.cu_k[1:].tolist()
    ):
        keys = seg.key_rows[k0:k1]
        assert torch.equal(plan.position_ids[keys], torch.arange(k1 - k0))
        assert torch.equal(keys[k1 - k0 - (q1 - q0) :], torch.arange(q0, q1))  # queries = the last keys
        assert q1 - q0 <= seg.max_q and k1 - k0 <= seg.max_k
    padded = plan.padded
    assert torch.equal(padded.q_rows[padded.out_rows], torch.arange(t_c))


def test_plan_is_none_without_shared_starts():
    input_ids = torch.tensor([1, 2, 3, 4, 5, 6])
    assert plan_shared_prefixes(input_ids, torch.tensor([2, 2, 2])) is None
    with pytest.raises(ValueError, match="sum to"):
        plan_shared_prefixes(input_ids, torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="max_run"):
        plan_shared_prefixes(input_ids, torch.tensor([3, 3]), max_run=0)


def test_plan_splits_runs_at_max_run():
    input_ids = torch.tensor([7, 8, 1] * 5)
    plan = plan_shared_prefixes(input_ids, torch.tensor([3] * 5), max_run=2)
    # identical samples; runs of at most 2: (2 samples, 3 shared) x 2 + 1 alone
    assert plan.saved_tokens == 3 + 3


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_shared_forward_equals_unshared_with_gradients(family, temperature):
    model = _tiny(family)
    input_ids, seq_lens = _groups_row()
    results = []
    for share in (False, True):
        model.zero_grad()
        logprobs, entropy = packed_logprobs_and_entropy(
            model, input_ids, seq_lens, temperature=temperature, share_prefixes=share
        )
        weights = torch.linspace(-1, 1, len(logprobs), dtype=logprobs.dtype)
        (weights * logprobs).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results.append((logprobs.detach(), entropy, grads))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-10)
    _assert_grads_close(g1, g0)
    assert any(float(g.abs().sum()) > 0 for g in g1.values())


def test_lora_policy_shares_too():
    model = _tiny("qwen2")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:  # zero at init: make the adapter change the output
                param.normal_(0, 0.1)
    input_ids, seq_lens = _groups_row(seed=3)
    grads = []
    for share in (False, True):
        packed = PackedLogprobs(lora, share_prefixes=share)
        lora.zero_grad()
        logprobs, _entropy = packed(input_ids, seq_lens)
        logprobs.sum().backward()
        grads.append({n: p.grad.clone() for n, p in lora.named_parameters() if p.requires_grad})
    assert all("lora_" in n for n in grads[0])
    _assert_grads_close(grads[1], grads[0])


def test_row_without_shared_starts_takes_the_plain_path():
    model = _tiny("qwen2")
    input_ids = torch.arange(12) % VOCAB
    seq_lens = torch.tensor([4, 8])
    assert plan_shared_prefixes(input_ids, seq_lens) is None
    shared = packed_logprobs_and_entropy(model, input_ids, seq_lens, share_prefixes=True)
    plain = packed_logprobs_and_entropy(model, input_ids, seq_lens)
    torch.testing.assert_close(shared[0], plain[0], rtol=0, atol=0)


def test_packed_module_reports_decoder_tokens():
    model = _tiny("qwen2")
    input_ids, seq_lens = _groups_row()
    for share, expected in ((False, len(input_ids)), (True, len(plan_shared_prefixes(input_ids, seq_lens).row_ids))):
        packed = PackedLogprobs(model, share_prefixes=share)
        packed(input_ids, seq_lens)
        assert packed.stats["decoder_tokens"] == expected


def varlen_attention_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scaling: float | None,
) -> torch.Tensor:
    """`trainer.kernels.varlen_attention.varlen_attention` as a loop of sdpa calls (any device, dtype):
    the CPU stand-in for the CUDA kernel (also tests/gpu/test_gpu_shared_prefix.py's reference).

    Segment i: queries `query[cu_q[i]:cu_q[i+1]]` (Lq), keys/values `key[cu_k[i]:cu_k[i+1]]` (Lk
    >= Lq); query j sees keys 0..Lk-Lq+j (causal, aligned bottom-right, flash-attention's
    convention). max_q, max_k are unused (the kernel's signature).

    Args:
        query: `[Tq, heads, head_dim]`; key, value: `[Tk, kv_heads, head_dim]` (kv_heads divides heads).
        cu_q, cu_k: `[N + 1]` integer segment offsets.

    Returns:
        `[Tq, heads, head_dim]` in the query's dtype.

    Raises:
        ValueError: a segment with more queries than keys.
    """
    del max_q, max_k
    outs = []
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        lq, lk = q1 - q0, k1 - k0
        if lq > lk:
            raise ValueError(f"segment with {lq} queries and {lk} keys: a segment's queries are its last keys")
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(lk - lq)
        q, k, v = (t.transpose(0, 1)[None] for t in (query[q0:q1], key[k0:k1], value[k0:k1]))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def _grpo_row(seed: int = 0, num_prompts: int = 3, group: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A GRPO-shaped packed micro-batch: `num_prompts` prompts (4 template tokens in common, 8-19
    tokens) x `group` completions of 1-24 tokens, starting mid-group (the first group's last 2)."""
    rng = np.random.default_rng(seed)
    template = rng.integers(0, VOCAB, 4).tolist()
    samples = []
    for _ in range(num_prompts):
        prompt = template + rng.integers(0, VOCAB, int(rng.integers(4, 16))).tolist()
        samples += [prompt + rng.integers(0, VOCAB, int(rng.integers(1, 25))).tolist() for _ in range(group)]
    samples = samples[group - 2 :]
    return torch.tensor(sum(samples, [])), torch.tensor([len(s) for s in samples])


def _float32_tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(config).train()


def _use_flat_reference(monkeypatch) -> list[int]:
    """Make segment_attention take the varlen path, with the CPU reference for the CUDA kernel;
    returns a list that gets the number of segments of each call."""
    calls: list[int] = []

    def reference(query, key, value, cu_q, *args):
        calls.append(len(cu_q) - 1)
        return varlen_attention_reference(query, key, value, cu_q, *args)

    monkeypatch.setattr(shared_prefix, "varlen_kernel_applies", lambda query, dropout_p: dropout_p == 0)
    monkeypatch.setattr(shared_prefix, "varlen_attention", reference)
    return calls


def _logprobs_and_grads(model, input_ids, seq_lens, share: bool, dtype: torch.dtype):
    model.zero_grad()
    with PrecisionPolicy(dtype).autocast("cpu"):
        logprobs, _entropy = packed_logprobs_and_entropy(model, input_ids, seq_lens, share_prefixes=share)
    weights = torch.linspace(-1, 1, len(logprobs))
    (weights * logprobs).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_grpo_plan_starts_mid_group_and_keeps_groups():
    input_ids, seq_lens = _grpo_row()
    plan = plan_shared_prefixes(input_ids, seq_lens)
    assert plan is not None
    # the two leftover samples share their prompt, then each whole group its own: 3 prefixes
    # (each its group's whole prompt: completions start with random tokens), every sample a tail
    prefix_lens = [int(p) for _q0, _n, _p0, p in plan.table if p > 0]
    assert len(plan.table) == 3 + len(seq_lens) and len(set(prefix_lens)) == 3
    _assert_segments_are_samples(plan)


@pytest.mark.parametrize("layout", ["padded", "padded-per-length", "flat"])
def test_flat_and_padded_attention_equal_per_sample_attention(layout, monkeypatch):
    """Attention alone, float64, grouped-query heads: the flat segments through the CPU reference
    of the varlen kernel, and the padded batches (two, or one per distinct length with no cost
    per call), give per-sample causal attention's outputs and q/k/v gradients."""
    if layout == "padded-per-length":
        monkeypatch.setattr(shared_prefix, "BATCH_CALL_COST", 0)
    input_ids, seq_lens = _grpo_row(seed=1)
    plan = plan_shared_prefixes(input_ids, seq_lens)
    if layout == "padded-per-length":
        assert len(plan.padded.masks) == len({(int(q), int(q + p)) for _, q, _, p in plan.table})
    elif layout == "padded":
        assert len(plan.padded.masks) == 2  # short segments: prefixes, tails
    gen = torch.Generator().manual_seed(0)
    t_c = len(plan.row_ids)

    def rand(heads):
        return torch.randn(1, t_c, heads, 16, generator=gen, dtype=torch.float64).transpose(1, 2).requires_grad_()

    q, k, v = rand(4), rand(2), rand(2)
    weight = torch.randn(1, t_c, 4, 16, generator=gen, dtype=torch.float64)
    results = []
    for run in ("reference", layout):
        if run == "flat":
            out = flat_segment_attention(q, k, v, plan.segments, None, varlen_attention_reference)
        else:  # per-sample causal sdpa on the unshared row is the ground truth for "reference"
            out = (
                _per_sample(q, k, v, plan)
                if run == "reference"
                else padded_segment_attention(q, k, v, plan.padded, None, 0.0)
            )
        (out * weight).sum().backward()
        results.append((out.detach(), [t.grad.clone() for t in (q, k, v)]))
        for t in (q, k, v):
            t.grad = None
    (ref, ref_grads), (got, got_grads) = results
    assert got.shape == (1, t_c, 4, 16)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def _per_sample(q, k, v, plan):
    """`[1, T_c, H, d]`: each compressed row's attention over its sample's rows 0..own position,
    one causal sdpa per sample, the rows read through `expand` (independent of the segment layout)."""
    expand = plan.expand
    out = torch.zeros(1, q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)
    position = plan.position_ids[expand]
    starts = torch.nonzero(position == 0).flatten().tolist() + [len(expand)]
    for s, e in zip(starts, starts[1:]):
        rows = expand[s:e]
        qs, ks, vs = (t[:, :, rows] for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        out = out.index_put((torch.zeros_like(rows), rows), o[0].transpose(0, 1))  # shared rows: same value
    return out


@pytest.mark.parametrize("layout", ["padded", "padded-per-length", "flat"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16-autocast"])
def test_grpo_batch_shared_equals_unshared_logprobs_and_gradients(layout, dtype, monkeypatch):
    """Float32 model on a GRPO-shaped micro-batch starting mid-group: shared prefixes on and off
    give the same logprobs and parameter gradients: to float32 rounding (float32: 5e-6 nats on
    logprobs of ~-5.7, 5e-6 of each gradient's largest entry; measured 5e-7 and 7e-7), or under bfloat16
    autocast (both sides round every matmul input to 8 mantissa bits, in a different order) no further apart
    than the unshared
    bfloat16 forward is from float32 (max logprob error; relative L2 error of the whole gradient),
    and the shared one no more than twice as far from float32 as the unshared one."""
    calls = _use_flat_reference(monkeypatch) if layout == "flat" else []
    if layout == "padded-per-length":
        monkeypatch.setattr(shared_prefix, "BATCH_CALL_COST", 0)
    model = _float32_tiny()
    input_ids, seq_lens = _grpo_row(seed=2, num_prompts=4, group=5)
    off, off_grads = _logprobs_and_grads(model, input_ids, seq_lens, False, dtype)
    on, on_grads = _logprobs_and_grads(model, input_ids, seq_lens, True, dtype)
    # one call per layer over 4 prefixes + 17 tails (the packed path without a plan never calls it)
    assert calls == ([4 + len(seq_lens)] * 2 if layout == "flat" else [])
    if dtype == torch.float32:
        torch.testing.assert_close(on, off, rtol=0, atol=5e-6)
        for name, grad in off_grads.items():
            scale = float(grad.abs().max())
            torch.testing.assert_close(on_grads[name], grad, rtol=1e-5, atol=5e-6 * scale, msg=name)
        return
    exact, exact_grads = _logprobs_and_grads(model, input_ids, seq_lens, False, torch.float32)
    on_err, off_err = float((on - exact).abs().max()), float((off - exact).abs().max())
    print(
        f"logprobs off float32 by {off_err:.2e} (off) {on_err:.2e} (on), on vs off {float((on - off).abs().max()):.2e}"
    )
    assert float((on - off).abs().max()) <= off_err and on_err <= 2 * off_err
    flat = [torch.cat([g[n].flatten() for n in sorted(g)]).double() for g in (on_grads, off_grads, exact_grads)]
    on_vs_off, on_vs_exact, off_vs_exact = (
        float((flat[a] - flat[b]).norm() / flat[b].norm()) for a, b in ((0, 1), (0, 2), (1, 2))
    )
    print(
        f"gradient relative L2 error: off vs float32 {off_vs_exact:.2e}, on vs float32 {on_vs_exact:.2e}, "
        f"on vs off {on_vs_off:.2e}"
    )
    assert on_vs_off <= 2 * off_vs_exact and on_vs_exact <= 2 * off_vs_exact


def test_share_prefixes_auto_rule():
    """`share_prefixes: auto` (the measured rule): always on a CPU; on CUDA only for micro-batches of
    at least SHARE_MIN_TOKENS_CUDA tokens; true/false as given; anything else refused."""
    from trainer.forward.packed import SHARE_MIN_TOKENS_CUDA, sharing_applies

    assert sharing_applies("auto", "cpu", 8) and sharing_applies("auto", "cpu", 10**6)
    assert not sharing_applies("auto", "cuda", SHARE_MIN_TOKENS_CUDA - 1)
    assert sharing_applies("auto", "cuda", SHARE_MIN_TOKENS_CUDA)
    assert sharing_applies(True, "cuda", 8) and not sharing_applies(False, "cpu", 10**6)
    with pytest.raises(ValueError, match="true, false or 'auto'"):
        sharing_applies("sometimes", "cpu", 8)


def test_trainer_config_accepts_auto_and_bools():
    from configs.schema import TrainerConfig

    assert TrainerConfig().share_prefixes == "auto"
    assert TrainerConfig(share_prefixes=False).share_prefixes is False
    assert TrainerConfig(share_prefixes=True).share_prefixes is True
    with pytest.raises(ValueError):
        TrainerConfig(share_prefixes="sometimes")
