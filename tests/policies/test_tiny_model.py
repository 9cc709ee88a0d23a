"""The tiny default policy: byte tokenizer, chat template, model size, ensure_policy cache;
and the reverse_text dataset it is trained on."""

import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from policies.tiny_model import (
    DONE_MARKER,
    IM_END_TOKEN_ID,
    IM_START_TOKEN_ID,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    build_random_policy,
    count_parameters,
    ensure_policy,
)
from policies.warm_start import SFT_LOSS_WINDOW
from tasks.registry import load_task_examples
from tasks.reverse_text import split_of
from tasks.task import render_messages


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return build_random_policy(tmp_path_factory.mktemp("tiny") / "policy", seed=0)


@pytest.fixture(scope="module")
def tokenizer(policy_dir):
    return AutoTokenizer.from_pretrained(policy_dir)


@pytest.mark.parametrize(
    "text",
    ["hello", "olleh dlrow", " lead\n\ttab  ", "héllo wörld", "e\u0301", "日本語", "<x>"],
)
def test_tokenizer_round_trips_exactly(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())  # one token per byte: no merges, no normalizer
    assert tokenizer.decode(ids) == text


def test_byte_ids_and_special_tokens(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE == 259
    assert tokenizer.encode("aZ\n", add_special_tokens=False) == [97, 90, 10]
    assert tokenizer.pad_token_id == PAD_TOKEN_ID == 256
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == IM_START_TOKEN_ID == 257
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == IM_END_TOKEN_ID == 258
    assert tokenizer.encode("ab<|im_end|>", add_special_tokens=False) == [97, 98, 258]
    assert tokenizer.decode([97, 98, 258], skip_special_tokens=True) == "ab"


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "abc"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n")
    no_gen = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert no_gen == "<|im_start|>user\nabc<|im_end|>\n"


def test_random_policy_size_and_format(policy_dir):
    assert (policy_dir / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not model.config.tie_word_embeddings
    assert model.config.vocab_size == VOCAB_SIZE
    assert next(model.parameters()).dtype.is_floating_point
    assert str(next(model.parameters()).dtype) == "torch.float32"
    # 2 * 259 * 128 (embed + lm_head) + 4 * (4 * 128^2 + 3 * 128 * 512 + 2 * 32 + 2 * 128) + 128
    assert count_parameters(model) == 1_116_288


def test_random_policy_is_deterministic_in_seed(tmp_path):
    a = build_random_policy(tmp_path / "a", hidden_size=32, num_layers=1, seed=3)
    b = build_random_policy(tmp_path / "b", hidden_size=32, num_layers=1, seed=3)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="hidden_size"):
        build_random_policy(tmp_path / "c", hidden_size=48)


def test_ensure_policy_builds_once_and_caches(tmp_path):
    kwargs = dict(sft_steps=2, seed=0, hidden_size=32, num_layers=1, sft_batch_size=4, sft_target_loss=None)
    path = ensure_policy(tmp_path, **kwargs)
    marker = json.loads((path / DONE_MARKER).read_text())
    assert marker["sft"]["steps"] == 2
    assert marker["params"]["sft_steps"] == 2
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_policy(tmp_path, **kwargs) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # not rebuilt
    assert AutoTokenizer.from_pretrained(path).eos_token_id == IM_END_TOKEN_ID
    other = ensure_policy(tmp_path, **{**kwargs, "seed": 1})
    assert other != path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    with pytest.raises(ValueError, match="sft_steps"):
        ensure_policy(tmp_path, sft_steps=-1)


def test_sft_stops_at_target_loss_or_warns(tmp_path):
    tiny = dict(seed=0, hidden_size=32, num_layers=1, sft_batch_size=4)
    # Any loss is below 100 nats: the run stops as soon as the loss window is full.
    easy = ensure_policy(tmp_path, sft_steps=50, sft_target_loss=100.0, **tiny)
    assert json.loads((easy / DONE_MARKER).read_text())["sft"]["steps"] == SFT_LOSS_WINDOW
    with pytest.warns(UserWarning, match="raise sft_steps"):
        ensure_policy(tmp_path, sft_steps=2, sft_target_loss=0.01, **tiny)


def test_reverse_text_examples_are_deterministic_and_disjoint():
    train = load_task_examples("reverse_text", "train", 2000, 0)
    assert train == load_task_examples("reverse_text", "train", 2000, 0)
    assert train[:10] == load_task_examples("reverse_text", "train", 10, 0)
    eval_ = load_task_examples("reverse_text", "eval", 128, 1234)
    assert len(eval_) == 128 and len({e["prompt"] for e in eval_}) == 128
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in eval_}
    assert all(split_of(e["prompt"]) == "eval" for e in eval_)
    ex = train[0]
    assert set(ex) == {"id", "prompt", "info"}
    assert ex["info"]["target"] == ex["prompt"][::-1]
    assert json.loads(json.dumps(ex)) == ex
    assert render_messages(ex) == [{"role": "user", "content": ex["prompt"]}]
    assert render_messages(ex, "sys")[0] == {"role": "system", "content": "sys"}


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        (dict(task="nope", split="train"), "task"),
        (dict(task="reverse_text", split="test"), "split"),
    ],
)
def test_unknown_task_or_split(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        load_task_examples(num_examples=1, seed=0, **kwargs)
