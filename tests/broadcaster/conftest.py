"""Shared fixtures of the broadcaster tests: one torch thread, a tiny random Qwen3 policy on disk
(the default policy's architecture, 2 layers x 64 wide)."""

from __future__ import annotations

import pytest
import torch

from trainer.tiny_model import build_random_policy


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny tensors: one thread is fastest, and avoids OpenMP spin-waits on a shared 2-core host."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return build_random_policy(tmp_path_factory.mktemp("tiny_policy"), hidden_size=64, num_layers=2, seed=0)
