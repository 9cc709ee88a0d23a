"""Shared fixtures of the trainer tests: a tiny random Qwen2 saved to disk, one torch thread."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.torch_threads import one_torch_thread  # noqa: F401 - autouse fixture


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)
