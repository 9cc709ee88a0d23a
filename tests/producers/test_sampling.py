"""Tests for producers.sampling: the per-prompt request parameters."""

from __future__ import annotations

from bus.messages import Prompt
from configs.schema import load_config
from producers.sampling import request_kwargs


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def _prompt(index: int, **kw) -> Prompt:
    return Prompt(id="x", index=index, step=0, task="reverse_text", messages=[], info={}, **kw)


def test_request_kwargs_for_training_and_eval_prompts():
    cfg = _cfg(
        "producers.group_size=4",
        "sampling.max_tokens=20",
        "sampling.min_tokens=8",
        "sampling.top_p=0.9",
        "sampling.repetition_penalty=1.1",
        "sampling.seed=100",
        "eval.max_tokens=6",
        "eval.tasks=[{name: reverse_text, rollouts_per_example: 3}]",
    )
    train = request_kwargs(cfg, _prompt(5, temperature=0.7))
    assert train == dict(
        n=4, temperature=0.7, top_p=0.9, max_tokens=20, min_tokens=8, repetition_penalty=1.1, seed=100 + 5 * 4
    )
    ev = request_kwargs(cfg, _prompt(2, temperature=0.5, eval_round=3, eval_size=10))
    assert ev == dict(
        n=3, temperature=0.5, top_p=0.9, max_tokens=6, min_tokens=6, repetition_penalty=1.1, seed=100 + 2 * 3
    )
    unknown = Prompt(id="y", index=0, step=0, task="gsm8k", messages=[], info={}, eval_round=0, eval_size=1)
    assert request_kwargs(cfg, unknown)["n"] == 1
    assert request_kwargs(_cfg(), _prompt(5))["seed"] is None
    # default eval tasks (none configured): the training task with rollouts_per_example 1
    assert request_kwargs(_cfg("producers.group_size=4"), _prompt(0, eval_round=0, eval_size=1))["n"] == 1
