"""Tests for trainer.packed: packed forward == per-sample unpacked forward, on a tiny random Qwen2."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from trainer.packed import block_causal_mask, packed_position_ids, packed_token_logprobs

SEQ_LENS = [5, 9, 1, 7]  # includes a 1-token sample (its only logprob is 0)
VOCAB = 300


def _tiny_qwen2(attn_implementation: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA, as in real Qwen2 checkpoints
        max_position_embeddings=64,
        tie_word_embeddings=False,
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
