"""Tests for trainer.forward.shared_prefix: the shared-prefix forward gives the unshared forward's numbers.

Rows are built like GRPO micro-batches: groups of completions of one prompt, adjacent, plus the
awkward cases (a micro-batch starting mid-group, two identical completions, a completion that is a
prefix of another, one-token samples). Every comparison is against the plain packed forward
(`trainer.forward.packed`, itself tested against unpacked forwards), for logprobs, entropy and every
parameter's gradient. The models are float64, but Qwen's RMSNorm computes in float32 whatever the
input dtype, so both paths agree to float32 rounding of the gradients (~1e-7 relative), not float64's:
`_assert_grads_close` allows 1e-6 of each gradient's largest entry.
"""

import numpy as np
import peft
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from trainer.forward.packed import PackedLogprobs, packed_logprobs_and_entropy
from trainer.forward.shared_prefix import plan_shared_prefixes

VOCAB = 300


def _tiny(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
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
        prompt_a + comp[0], prompt_a + comp[1],
        prompt_b + comp[2], prompt_b + comp[2], prompt_b + comp[2][:3], prompt_b + comp[3],
        rng.integers(0, VOCAB, 8).tolist(),
        [int(rng.integers(0, VOCAB))],
        prompt_c + comp[0], prompt_c + comp[1], prompt_c + comp[3],
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
    # each compressed row is the valid query of exactly one segment, found where `order` says
    queries = torch.cat([b.q_idx[b.valid] for b in plan.batches])
    assert len(plan.batches) == 2 and len(queries) == len(plan.row_ids)
    assert torch.equal(queries[plan.order], torch.arange(len(plan.row_ids)))


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
