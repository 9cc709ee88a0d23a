"""The model families rlbus trains (policies.model_families): Qwen2.5, Qwen3 and Llama-3 at toy size,
tied and untied, through the trainer's real code paths on CPU.

- the tokenizer renders the family's real chat template (exact strings of the public templates),
  ends a turn with the family's eos, and decoding with ``skip_special_tokens`` (what the producer
  hands the reward) drops it while Qwen3's ``<think>`` tags (not special) survive;
- the trainer's packed logprobs (one forward over a packed row with rlbus_packed_sdpa's
  block-causal mask) equal an unpacked HF forward of each sample, to float32 rounding;
- one train step on packed micro-batches moves the weights, keeps a tied lm_head tied, and trains
  each completion's closing eos token exactly once.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from bus.messages import ScoredGroup
from configs.schema import LoraSection, OptimConfig, TrainerConfig
from trainer.state.model import load_policy
from policies.model_families import FAMILIES, build_family_model, family
from trainer.forward.packed import packed_token_logprobs
from trainer.trainer import Trainer
from tests.scored_groups import packed_step, sample_tokens, scored

VARIANTS = [(name, tied) for name in FAMILIES for tied in (True, False)]
MESSAGES = [
    [{"role": "user", "content": "Reverse: abc"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo"}],
    [{"role": "user", "content": "x"}],
]
LOGPROB_ATOL = 1e-5  # float32 packed vs unpacked, measured max abs diff ~1e-6


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[tuple[str, bool], str]:
    root = tmp_path_factory.mktemp("families")
    return {
        (name, tied): str(build_family_model(root / f"{name}-{'tied' if tied else 'untied'}", name, tied=tied, seed=3))
        for name, tied in VARIANTS
    }


def _ids(variant) -> str:
    return f"{variant[0]}-{'tied' if variant[1] else 'untied'}"


EXPECTED_PROMPT = {
    "qwen2.5": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_start|>user\nReverse: abc<|im_end|>\n<|im_start|>assistant\n",
    "llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nReverse: abc<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tokenizer_renders_the_family_template_and_eos(family_dirs, name):
    path = family_dirs[(name, True)]
    fam = family(name)
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(MESSAGES[0], tokenize=False, add_generation_prompt=True)
    assert text == EXPECTED_PROMPT[name]
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text  # byte-level: exact round trip, special tokens single ids
    assert tok.eos_token == fam.eos and tok.eos_token_id == fam.token_id(fam.eos)
    assert GenerationConfig.from_pretrained(path).eos_token_id == fam.stop_ids
    assert ids.count(fam.token_id(fam.eos)) == text.count(fam.eos) >= 1  # one id per closed turn
    if fam.bos:
        assert ids[0] == tok.bos_token_id == fam.token_id(fam.bos) and ids.count(ids[0]) == 1
    completion = tok.encode("<think>\nhm\n</think>\n\ncba" if name == "qwen3" else "cba", add_special_tokens=False)
    reward_text = tok.decode(completion + [fam.token_id(fam.eos)], skip_special_tokens=True)
    assert reward_text == ("<think>\nhm\n</think>\n\ncba" if name == "qwen3" else "cba")
    if name == "qwen3":
        no_think = tok.apply_chat_template(
            MESSAGES[0], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert no_think == text + "<think>\n\n</think>\n\n"
        history = MESSAGES[0] + [
            {"role": "assistant", "content": "<think>\nhm\n</think>\n\ncba"},
            {"role": "user", "content": "again"},
        ]
        assert "<think>" not in tok.apply_chat_template(history, tokenize=False)  # old reasoning is dropped


def _samples(path: str, model) -> list[ScoredGroup]:
    """Chat-templated prompts + random completions closed by the family's eos, own logprobs."""
    tok = AutoTokenizer.from_pretrained(path)
    eos = tok.eos_token_id
    gen = np.random.default_rng(0)
    out = []
    for k, messages in enumerate(MESSAGES):
        prompt = tok.encode(
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
        completion = [int(t) for t in gen.integers(32, 127, size=3 + 2 * k)] + [eos]
        ids = prompt + completion
        with torch.no_grad():
            lp = packed_token_logprobs(model, torch.tensor(ids), torch.tensor([len(ids)])).numpy()
        out.append(scored(f"g{k}", prompt, [completion], advantages=[1.0 - k], logprobs=[lp[len(prompt) :]]))
    return out


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_packed_logprobs_equal_an_unpacked_hf_forward(family_dirs, variant):
    path = family_dirs[variant]
    model = load_policy(path, LoraSection()).eval()
    assert type(model).__name__ == family(variant[0]).architecture
    assert model.config.tie_word_embeddings is variant[1]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is variant[1]
    samples = _samples(path, model)
    tokens = [sample_tokens(s)[0] for s in samples]
    input_ids = torch.tensor(np.concatenate(tokens))
    lens = torch.tensor([len(t) for t in tokens])
    with torch.no_grad():
        packed = packed_token_logprobs(model, input_ids, lens)
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        pieces = []
        for t in tokens:
            ids = torch.tensor(t, dtype=torch.long)
            logp = torch.log_softmax(reference(input_ids=ids[None]).logits[0].float(), dim=-1)
            pieces.append(torch.cat([torch.zeros(1), logp[:-1].gather(1, ids[1:, None])[:, 0]]))
    expected = torch.cat(pieces)
    assert packed.shape == expected.shape == (int(lens.sum()),)
    torch.testing.assert_close(packed, expected, atol=LOGPROB_ATOL, rtol=0)
    assert expected[1:].abs().max() > 1.0  # real logprobs, not zeros


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_a_train_step_runs_and_trains_each_eos_once(family_dirs, variant):
    path = family_dirs[variant]
    model = load_policy(path, LoraSection())
    samples = _samples(path, model)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    n_loss = int(sum(s.completion_lens.sum() for s in samples))
    mbs = packed_step(samples, [[0, 1], [2]])
    for mb in mbs:  # the loss covers each sample's completion, closing eos included, once
        ends = np.cumsum(mb.seq_lens)
        for start, end in zip(ends - mb.seq_lens, ends):
            trained = mb.input_ids[start:end][mb.loss_mask[start:end]]
            assert trained[-1] == eos and int((trained == eos).sum()) == 1
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    m = Trainer(model, TrainerConfig(optim=OptimConfig(lr=1e-3, max_grad_norm=1e9))).step(mbs)
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0
    assert m["num_loss_tokens"] == n_loss and m["onpolicy_lp_diff_max"] < 1e-5
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is variant[1]


def test_the_bench_shape_is_qwen2_5_0_5b():
    """QWEN2_5_0_5B has Qwen2.5-0.5B's parameter count (494,032,768, tied; model card: 0.49B), on the meta device."""
    from policies.model_families import QWEN2_5_0_5B, TINY, Shape, family_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(family_config("qwen2.5", tied=True, shape=QWEN2_5_0_5B))
    assert sum(p.numel() for p in model.parameters()) == 494_032_768
    with pytest.raises(ValueError, match="vocab_size=100 is below"):
        family_config("llama3", tied=False, shape=Shape(**{**TINY.__dict__, "vocab_size": 100}))
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        family_config("gpt2", tied=False)
