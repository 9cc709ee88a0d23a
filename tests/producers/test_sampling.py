"""Tests for producers.sampling: the temperature schedule and the per-prompt request parameters."""

from __future__ import annotations

import math

import pytest

from bus.messages import Prompt
from configs.schema import load_config
from producers.sampling import eval_temperature, request_kwargs, temperature_at


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def test_constant_temperature_without_scheduler():
    sampling = _cfg("sampling.temperature=0.8").sampling
    assert [temperature_at(sampling, s, 10) for s in (0, 5, 9, 20)] == [0.8] * 4


def test_linear_schedule_from_start_to_end():
    sampling = _cfg("sampling.temp_scheduler={type: linear, start_temperature: 1.2, end_temperature: 0.4}").sampling
    got = [temperature_at(sampling, s, 5) for s in range(5)]
    assert got == pytest.approx([1.2, 1.0, 0.8, 0.6, 0.4])
    assert temperature_at(sampling, 7, 5) == pytest.approx(0.4)  # past the run: the end value
    assert temperature_at(sampling, 0, 1) == pytest.approx(1.2)  # a one-step run: t = 0


def test_cosine_schedule_is_a_half_cosine():
    sampling = _cfg("sampling.temp_scheduler={type: cosine, start_temperature: 1.0, end_temperature: 0.5}").sampling
    n = 9
    for s in range(n):
        t = s / (n - 1)
        assert temperature_at(sampling, s, n) == pytest.approx(0.5 + 0.5 * (1 + math.cos(math.pi * t)) / 2)
    assert temperature_at(sampling, 4, n) == pytest.approx(0.75)  # the midpoint
    assert temperature_at(sampling, 1, n) > 1.0 - 0.5 * 1 / 8 + 0.04  # flatter start than linear


def test_schedule_rejects_bad_steps():
    sampling = _cfg().sampling
    for step, max_steps in ((-1, 5), (0, 0)):
        with pytest.raises(ValueError, match="step"):
            temperature_at(sampling, step, max_steps)


def test_eval_temperature():
    assert eval_temperature(_cfg("eval.temperature=0.3")) == 0.3
    assert eval_temperature(_cfg("sampling.temperature=0.9")) == 0.9
    sched = _cfg("sampling.temp_scheduler={type: linear, start_temperature: 1.0, end_temperature: 0.6}")
    assert eval_temperature(sched) == pytest.approx(0.6)


def _prompt(index: int, **kw) -> Prompt:
    return Prompt(id="x", index=index, step=0, task="reverse_text", messages=[], info={}, **kw)


def test_request_kwargs_for_training_and_eval_prompts():
    cfg = _cfg("producers.group_size=4", "sampling.max_tokens=20", "sampling.min_tokens=8", "sampling.top_p=0.9",
               "sampling.repetition_penalty=1.1", "sampling.seed=100", "eval.max_tokens=6",
               "eval.tasks=[{name: reverse_text, rollouts_per_example: 3}]")
    train = request_kwargs(cfg, _prompt(5, temperature=0.7))
    assert train == dict(n=4, temperature=0.7, top_p=0.9, max_tokens=20, min_tokens=8, repetition_penalty=1.1,
                         seed=100 + 5 * 4)
    ev = request_kwargs(cfg, _prompt(2, temperature=0.5, eval_round=3, eval_size=10))
    assert ev == dict(n=3, temperature=0.5, top_p=0.9, max_tokens=6, min_tokens=6, repetition_penalty=1.1,
                      seed=100 + 2 * 3)
    unknown = Prompt(id="y", index=0, step=0, task="gsm8k", messages=[], info={}, eval_round=0, eval_size=1)
    assert request_kwargs(cfg, unknown)["n"] == 1
    assert request_kwargs(_cfg(), _prompt(5))["seed"] is None
    # default eval tasks (none configured): the training task with rollouts_per_example 1
    assert request_kwargs(_cfg("producers.group_size=4"), _prompt(0, eval_round=0, eval_size=1))["n"] == 1
