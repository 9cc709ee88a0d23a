"""Tests for trainer.forward.packed: packed forward == per-sample unpacked forward, on a tiny random Qwen2.

The packed path applies the LM head chunk by chunk (trainer.forward.logprobs); every reference here computes
the full `[T, V]` logits with the model's own forward, so the tests also check chunked == naive.
"""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer.forward.packed import (
    PackedLogprobs,
    block_causal_mask,
    packed_logprobs_and_entropy,
    packed_position_ids,
    packed_token_logprobs,
)

SEQ_LENS = [5, 9, 1, 7]  # includes a 1-token sample (its only logprob is 0)
VOCAB = 300


def _tiny_qwen2(attn_implementation: str, tie_word_embeddings: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, as in real Qwen2 checkpoints
        max_position_embeddings=64,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation=attn_implementation,
    )
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    assert model.config._attn_implementation == attn_implementation
    return model


def _packed_inputs():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (sum(SEQ_LENS),), generator=generator)
    return input_ids, torch.tensor(SEQ_LENS)


def _unpacked_reference(model, input_ids, temperature=1.0):
    """Each sample alone, no mask, default positions: logp[0] = 0, logp[t] = log_softmax(z[t-1]/T)[x[t]]."""
    pieces = []
    for sample in input_ids.split(SEQ_LENS):
        logits = model(input_ids=sample[None]).logits[0].float() / temperature
        logp = torch.log_softmax(logits, dim=-1)
        per_token = [torch.zeros(())] + [logp[t - 1, sample[t]] for t in range(1, len(sample))]
        pieces.append(torch.stack(per_token))
    return torch.cat(pieces)


def _unpacked_entropy(model, input_ids, temperature=1.0):
    """Each sample alone: entropy[0] = 0, entropy[t] = -sum_v p log p with p = softmax(z[t-1]/T)."""
    pieces = []
    for sample in input_ids.split(SEQ_LENS):
        logp = torch.log_softmax(model(input_ids=sample[None]).logits[0].float() / temperature, dim=-1)
        entropy = -(logp.exp() * logp).sum(-1)
        pieces.append(torch.cat([torch.zeros(1), entropy[:-1]]))
    return torch.cat(pieces)


def test_block_causal_mask_by_hand():
    neg = torch.finfo(torch.float32).min
    mask = block_causal_mask(torch.tensor([2, 1, 2]), torch.float32)
    allowed = torch.tensor(
        [  # keys ->   s0 s0 s1 s2 s2
            [1, 0, 0, 0, 0],  # q0 (s0)
            [1, 1, 0, 0, 0],  # q1 (s0)
            [0, 0, 1, 0, 0],  # q2 (s1)
            [0, 0, 0, 1, 0],  # q3 (s2)
            [0, 0, 0, 1, 1],  # q4 (s2)
        ],
        dtype=torch.bool,
    )
    assert mask.shape == (1, 1, 5, 5)
    assert mask.dtype == torch.float32
    assert torch.equal(mask[0, 0], torch.where(allowed, 0.0, neg))
    assert block_causal_mask(torch.tensor([3]), torch.bfloat16).dtype == torch.bfloat16


def test_packed_position_ids_by_hand():
    assert packed_position_ids(torch.tensor([2, 1, 3])).tolist() == [[0, 1, 0, 0, 1, 2]]
    assert packed_position_ids(torch.tensor([1])).tolist() == [[0]]


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_packed_matches_unpacked(attn_implementation):
    model = _tiny_qwen2(attn_implementation)
    input_ids, seq_lens = _packed_inputs()
    with torch.no_grad():
        packed = packed_token_logprobs(model, input_ids, seq_lens)
        reference = _unpacked_reference(model, input_ids)
    assert packed.shape == (sum(SEQ_LENS),) and packed.dtype == torch.float32
    assert (packed - reference).abs().max().item() <= 1e-5
    starts = [0, 5, 14, 15]
    assert packed[starts].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert (packed <= 0).all()


def test_temperature_divides_logits():
    model = _tiny_qwen2("sdpa")
    input_ids, seq_lens = _packed_inputs()
    with torch.no_grad():
        packed = packed_token_logprobs(model, input_ids, seq_lens, temperature=0.7)
        reference = _unpacked_reference(model, input_ids, temperature=0.7)
        untempered = packed_token_logprobs(model, input_ids, seq_lens)
    assert (packed - reference).abs().max().item() <= 1e-5
    assert (packed - untempered).abs().max().item() > 1e-3


def test_gradients_match_unpacked():
    model = _tiny_qwen2("sdpa")
    input_ids, seq_lens = _packed_inputs()
    packed_token_logprobs(model, input_ids, seq_lens).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _unpacked_reference(model, input_ids).sum().backward()
    for packed_grad, param in zip(packed_grads, model.parameters()):
        torch.testing.assert_close(packed_grad, param.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_peft_lora_model_matches_unpacked(attn_implementation):
    peft = pytest.importorskip("peft")
    model = _tiny_qwen2(attn_implementation)
    input_ids, seq_lens = _packed_inputs()
    with torch.no_grad():
        base = packed_token_logprobs(model, input_ids, seq_lens)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:  # zero at init: make the adapter change the output
                param.normal_(0.0, 0.5)
        packed = packed_token_logprobs(lora, input_ids, seq_lens)
        reference = _unpacked_reference(lora, input_ids)
    assert (packed - base).abs().max().item() > 1e-3, "LoRA must change the logprobs"
    assert (packed - reference).abs().max().item() <= 1e-5


def test_bad_inputs_raise():
    model = _tiny_qwen2("sdpa")
    input_ids, seq_lens = _packed_inputs()
    with pytest.raises(ValueError, match="seq_lens must sum to len"):
        packed_token_logprobs(model, input_ids, torch.tensor([5, 9]))
    with pytest.raises(ValueError, match="seq_lens must all be >= 1"):
        packed_token_logprobs(model, input_ids, torch.tensor([22, 0]))
    with pytest.raises(ValueError, match="seq_lens must be an integer tensor"):
        block_causal_mask(torch.tensor([2.0]), torch.float32)
    with pytest.raises(ValueError, match="input_ids must be a 1-D integer tensor"):
        packed_token_logprobs(model, input_ids[None], seq_lens)
    with pytest.raises(ValueError, match="temperature must be"):
        packed_token_logprobs(model, input_ids, seq_lens, temperature=0.0)
    with pytest.raises(ValueError, match="dtype must be a floating"):
        block_causal_mask(seq_lens, torch.int64)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attention implementation 'flash_attention_2' is not supported"):
        packed_token_logprobs(model, input_ids, seq_lens)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 64])  # 22 tokens: 64 > T, 7 and 4 do not divide T - 1
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_logprobs_and_entropy_match_unpacked(attn_implementation, chunk_size):
    model = _tiny_qwen2(attn_implementation)
    input_ids, seq_lens = _packed_inputs()
    with torch.no_grad():
        logprobs, entropy = packed_logprobs_and_entropy(
            model, input_ids, seq_lens, temperature=0.7, chunk_size=chunk_size
        )
        ref_logprobs = _unpacked_reference(model, input_ids, temperature=0.7)
        ref_entropy = _unpacked_entropy(model, input_ids, temperature=0.7)
    assert logprobs.dtype == entropy.dtype == torch.float32 and entropy.shape == (sum(SEQ_LENS),)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-5)
    starts = [0, 5, 14, 15]
    assert entropy[starts].tolist() == [0.0] * 4
    assert (entropy[[t for t in range(sum(SEQ_LENS)) if t not in starts]] > 0).all()


def _naive_packed(model, input_ids, seq_lens, temperature):
    """The full-logits packed path: model(...).logits [T, V] -> log_softmax -> gather, entropy, shift."""
    logits = (
        model(
            input_ids=input_ids[None],
            attention_mask=block_causal_mask(seq_lens, torch.float32),
            position_ids=packed_position_ids(seq_lens),
            use_cache=False,
        )
        .logits[0]
        .float()
        / temperature
    )
    logp = torch.log_softmax(logits[:-1], dim=-1)
    lp = torch.cat([torch.zeros(1), logp.gather(1, input_ids[1:, None]).squeeze(1)])
    entropy = torch.cat([torch.zeros(1), -(logp.exp() * logp).sum(-1)])
    is_first = torch.zeros(len(input_ids), dtype=torch.bool)
    is_first[torch.cumsum(seq_lens, 0) - seq_lens] = True
    return torch.where(is_first, 0.0, lp), torch.where(is_first, 0.0, entropy).detach()


def _assert_chunked_equals_naive(model, input_ids, seq_lens, temperature, chunk_size):
    """Values and the gradients of sum(w * logprobs) w.r.t. every trainable parameter, to 1e-5."""
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(len(input_ids), generator=torch.Generator().manual_seed(3))
    lp, ent = packed_logprobs_and_entropy(model, input_ids, seq_lens, temperature=temperature, chunk_size=chunk_size)
    grads = torch.autograd.grad((weights * lp).sum(), params)
    ref_lp, ref_ent = _naive_packed(model, input_ids, seq_lens, temperature)
    ref_grads = torch.autograd.grad((weights * ref_lp).sum(), params)
    assert not ent.requires_grad
    torch.testing.assert_close(lp.detach(), ref_lp.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-5)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5)


def test_fixture_model_chunked_equals_naive(model_dir):
    model = Qwen2ForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa", dtype=torch.float32)
    input_ids, seq_lens = _packed_inputs()
    _assert_chunked_equals_naive(model.train(), input_ids, seq_lens, temperature=0.9, chunk_size=5)


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_tied_embeddings_chunked_equals_naive(chunk_size):
    model = _tiny_qwen2("sdpa", tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    input_ids, seq_lens = _packed_inputs()
    _assert_chunked_equals_naive(model, input_ids, seq_lens, temperature=1.2, chunk_size=chunk_size)


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_lora_chunked_equals_naive(tie_word_embeddings):
    peft = pytest.importorskip("peft")
    model = _tiny_qwen2("sdpa", tie_word_embeddings=tie_word_embeddings)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:  # zero at init: make the adapter matter, and its gradients differ
                param.normal_(0.0, 0.5)
    assert all("lora_" in name for name, p in lora.named_parameters() if p.requires_grad)
    input_ids, seq_lens = _packed_inputs()
    _assert_chunked_equals_naive(lora, input_ids, seq_lens, temperature=0.8, chunk_size=6)


def test_lora_on_lm_head_is_refused():
    peft = pytest.importorskip("peft")
    model = _tiny_qwen2("sdpa")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    input_ids, seq_lens = _packed_inputs()
    with pytest.raises(ValueError, match="keep lm_head out of the peft target_modules"):
        packed_logprobs_and_entropy(lora, input_ids, seq_lens)


def test_logit_rescaling_config_is_refused():
    model = _tiny_qwen2("sdpa")
    model.config.final_logit_softcapping = 30.0
    input_ids, seq_lens = _packed_inputs()
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        packed_logprobs_and_entropy(model, input_ids, seq_lens)


def test_packed_logprobs_module():
    model = _tiny_qwen2("sdpa")
    input_ids, seq_lens = _packed_inputs()
    module = PackedLogprobs(model, temperature=0.7, chunk_size=4)
    assert module.model is model and dict(module.named_parameters()).keys() == {
        f"model.{name}" for name, _ in model.named_parameters()
    }
    logprobs, entropy = module(input_ids, seq_lens)
    ref_logprobs, ref_entropy = packed_logprobs_and_entropy(model, input_ids, seq_lens, temperature=0.7)
    torch.testing.assert_close(logprobs, ref_logprobs, rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, ref_entropy, rtol=0, atol=1e-6)
    assert logprobs.requires_grad and not entropy.requires_grad
    with pytest.raises(ValueError, match="temperature must be"):
        PackedLogprobs(model, temperature=-1.0)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        PackedLogprobs(model, chunk_size=0)


def test_single_one_token_sample():
    """T = 1: no next-token prediction at all; outputs are [0.0] and the backward still runs."""
    model = _tiny_qwen2("sdpa")
    logprobs, entropy = packed_logprobs_and_entropy(model, torch.tensor([7]), torch.tensor([1]), chunk_size=4)
    assert logprobs.tolist() == [0.0] and entropy.tolist() == [0.0]
    logprobs.sum().backward()
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_varlen_attention_equals_the_dense_block_causal_mask(attn_implementation):
    """The per-sample (varlen) attention of the packed forward gives the logits of one dense
    forward with the block-diagonal causal mask, and leaves the model's implementation as it was."""
    model = _tiny_qwen2(attn_implementation)
    input_ids, seq_lens = _packed_inputs()
    with torch.no_grad():
        dense = model(
            input_ids=input_ids[None],
            attention_mask=block_causal_mask(seq_lens, torch.float32),
            position_ids=packed_position_ids(seq_lens),
            use_cache=False,
        ).logits[0]
        logp = torch.log_softmax(dense, dim=-1)
        next_lp = logp[:-1].gather(1, input_ids[1:, None]).squeeze(1)
        expected = torch.cat([torch.zeros(1), next_lp])
        expected[torch.cumsum(seq_lens, 0) - seq_lens] = 0.0
        varlen = packed_token_logprobs(model, input_ids, seq_lens)
    assert (varlen - expected).abs().max().item() <= 1e-5
    assert model.config._attn_implementation == attn_implementation  # restored after the forward


def test_varlen_attention_rejects_lengths_that_do_not_cover_the_row():
    from trainer.forward.packed_attention import packed_sdpa_attention

    q = torch.zeros(1, 4, 6, 8)
    kv = torch.zeros(1, 2, 6, 8)
    with pytest.raises(ValueError, match="sum to 5, the packed row has 6 tokens"):
        packed_sdpa_attention(torch.nn.Module(), q, kv, kv, None, rlbus_seq_lens=[2, 3])


@pytest.mark.parametrize("share_prefixes", [False, True])
def test_selected_tokens_only(share_prefixes):
    """`tokens` (the loss tokens): the same logprobs, entropy and gradients there, 0 elsewhere."""
    model = _tiny_qwen2("sdpa").train()
    input_ids, seq_lens = _packed_inputs()
    input_ids[9:11] = input_ids[:2]  # the second sample starts like the first: something to share
    tokens = torch.zeros(len(input_ids), dtype=torch.bool)
    tokens[[1, 3, 4, 6, 13, 20]] = True
    tokens[5] = True  # a sample's first token: no context, stays 0
    results = []
    for chosen in (None, tokens):
        model.zero_grad()
        logprobs, entropy = packed_logprobs_and_entropy(
            model, input_ids, seq_lens, share_prefixes=share_prefixes, tokens=chosen
        )
        (logprobs * tokens).sum().backward()
        results.append((logprobs.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp_all, ent_all, g_all), (lp, ent, g) = results
    assert torch.equal(lp[~tokens], torch.zeros_like(lp[~tokens])) and torch.equal(
        ent[~tokens], torch.zeros_like(ent[~tokens])
    )
    assert float(lp[5]) == 0.0 and float(ent[5]) == 0.0
    torch.testing.assert_close(lp[tokens], lp_all[tokens], rtol=0, atol=1e-6)
    torch.testing.assert_close(ent[tokens], ent_all[tokens], rtol=0, atol=1e-6)
    for name, grad in g_all.items():
        torch.testing.assert_close(g[name], grad, rtol=1e-4, atol=1e-6, msg=name)
