"""Shared fixtures of the broadcaster tests: one torch thread, a tiny random Qwen3 policy on disk
(the default policy's architecture, 2 layers x 64 wide)."""

from __future__ import annotations

import pytest

from tests.torch_threads import one_torch_thread  # noqa: F401 - autouse fixture
from policies.tiny_model import build_random_policy


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return build_random_policy(tmp_path_factory.mktemp("tiny_policy"), hidden_size=64, num_layers=2, seed=0)
