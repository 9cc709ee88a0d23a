"""Synthetic countdown problems: determinism, disjoint splits, reachable targets, example shape."""

from __future__ import annotations

import pytest

from tasks.countdown import (
    MAX_NUMBER,
    MAX_TARGET,
    MIN_NUMBER,
    countdown_examples,
    countdown_problems,
    split_of,
)
from tasks.countdown import countdown_reward


def test_deterministic_in_seed_and_prefix_stable():
    assert countdown_examples("train", 50, seed=3) == countdown_examples("train", 50, seed=3)
    assert countdown_examples("train", 20, seed=3) == countdown_examples("train", 50, seed=3)[:20]
    assert countdown_examples("train", 50, seed=3) != countdown_examples("train", 50, seed=4)


def test_splits_are_disjoint_whatever_the_seeds():
    train = {p.key() for seed in (0, 1) for p in countdown_problems("train", 1500, seed)}
    evals = {p.key() for seed in (0, 1) for p in countdown_problems("eval", 300, seed)}
    assert not train & evals
    # and by construction: every problem sits in the split its sha256 bucket names
    assert all(split_of(p) == "eval" for p in countdown_problems("eval", 300, 0))


def test_problems_are_distinct_within_a_call():
    problems = countdown_problems("eval", 500, seed=7)
    assert len({p.key() for p in problems}) == 500


def test_every_target_is_reached_by_its_generating_expression():
    problems = countdown_problems("train", 1000, seed=0) + countdown_problems("eval", 200, seed=0)
    for problem in problems:
        info = {"numbers": list(problem.numbers), "target": problem.target}
        completion = f"<answer>{problem.solution}</answer>"
        assert countdown_reward(completion, info) == 1.0, problem


def test_example_shape_and_ranges():
    examples = countdown_examples("train", 300, seed=0)
    sizes = set()
    for i, example in enumerate(examples):
        assert set(example) == {"id", "prompt", "info"}
        assert example["id"] == f"countdown/train/0/{i}"
        info = example["info"]
        assert set(info) == {"numbers", "target"}
        assert isinstance(info["target"], int) and 1 <= info["target"] <= MAX_TARGET
        assert all(type(n) is int and MIN_NUMBER <= n <= MAX_NUMBER for n in info["numbers"])
        sizes.add(len(info["numbers"]))
        assert ", ".join(map(str, info["numbers"])) in example["prompt"]
        assert f"equals {info['target']}." in example["prompt"]
        assert "<answer></answer>" in example["prompt"]
    assert sizes == {3, 4}
    assert countdown_examples("eval", 0, seed=0) == []


@pytest.mark.parametrize(
    "split, num_examples, match",
    [
        ("test", 1, "split"),
        ("validation", 1, "split"),
        ("train", -1, "num_examples"),
        ("eval", 1.5, "num_examples"),
    ],
)
def test_bad_arguments_are_value_errors(split, num_examples, match):
    with pytest.raises(ValueError, match=match):
        countdown_examples(split, num_examples, seed=0)
