"""Tests for prompts.temperature: the temperature schedule of training prompts and the eval temperature."""

from __future__ import annotations

import math

import pytest

from configs.schema import load_config
from prompts.temperature import eval_temperature, temperature_at


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
