"""Tests for packer.evaluation: eval ids, the per-task metrics by hand, and the aggregator's
rounds (completion by received + failed groups, dedupe, late groups, several tasks)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from bus.codec import decode, encode
from bus.messages import EvalResult
from packer.evaluation import EvalAggregator, EvalGroup, eval_metrics, parse_eval_id
from tests.scored_groups import scored


def eval_group(
    rnd: int,
    task: str,
    i: int,
    rewards: list[float],
    *,
    size: int,
    lens: list[int] | None = None,
    terms: dict | None = None,
    version: tuple[int, int] | None = None,
):
    """A scored eval group of ``len(rewards)`` completions (lengths ``lens``, default 1 token each)."""
    lens = lens or [1] * len(rewards)
    v0, v1 = version or (rnd, rnd)
    g = scored(
        f"e{rnd:06d}-{task}-{i:05d}",
        [1, 2],
        [[7] * n for n in lens],
        rewards=rewards,
        eval_round=rnd,
        eval_size=size,
        reward_terms=terms or {},
    )
    versions = dict(version_start=np.full(len(rewards), v0, np.int64), version_end=np.full(len(rewards), v1, np.int64))
    return dataclasses.replace(g, task=task, **versions)


def test_parse_eval_id():
    assert parse_eval_id("e000004-gsm8k-00012") == (4, "gsm8k")
    assert parse_eval_id("e1234567-my-task-00000") == (1234567, "my-task")  # dashes in task names
    assert parse_eval_id("e000004-pkg.mod:fn-00001") == (4, "pkg.mod:fn")
    for other in ("abc", "e12-gsm8k-00001", "e000004-gsm8k", "x000004-gsm8k-00001", "0123abcd" * 4):
        assert parse_eval_id(other) is None, other


def summary(rewards, lens=None, terms=None) -> EvalGroup:
    lens = lens or [1] * len(rewards)
    return EvalGroup(np.float64(rewards), np.int64(lens), terms or {}, 0, 0)


def test_eval_metrics_by_hand():
    # two examples x 2 rollouts: rewards [1, 0] and [0, 0]; lengths 2, 4, 6, 8
    groups = [
        summary([1.0, 0.0], [2, 4], {"gsm8k": [1.0, 0.0]}),
        summary([0.0, 0.0], [6, 8], {"gsm8k": [0.0, 0.0], "format": [1.0, 1.0]}),
    ]
    m = eval_metrics(groups)
    assert m["reward_mean"] == pytest.approx(0.25)
    assert m["reward_std"] == pytest.approx(math.sqrt((0.75**2 + 3 * 0.25**2) / 4))  # population std
    assert m["completion_len_mean"] == pytest.approx(5.0)
    assert m["reward/gsm8k"] == pytest.approx(0.25) and m["reward/format"] == pytest.approx(
        1.0
    )  # over those that carry it
    assert m["pass_at_2"] == pytest.approx(0.5)  # one of two examples solved
    assert set(m) == {"reward_mean", "reward_std", "completion_len_mean", "reward/gsm8k", "reward/format", "pass_at_2"}
    single = eval_metrics([summary([1.0]), summary([0.0])])
    assert single["pass_at_1"] == 0.5 and single["reward_mean"] == 0.5  # k = 1: pass@1
    partial = eval_metrics([summary([0.9]), summary([0.5])])
    assert partial["pass_at_1"] == 0.0 and partial["reward_mean"] == pytest.approx(0.7)  # a pass needs reward >= 1
    assert eval_metrics([]) == {}


def test_a_round_closes_once_received_plus_failed_groups_reach_its_size():
    agg = EvalAggregator()
    size = 4
    assert agg.add(eval_group(2, "gsm8k", 0, [1.0, 0.0], size=size, lens=[3, 5], version=(2, 3))) == ("taken", None)
    assert agg.add(eval_group(2, "countdown", 0, [0.0, 0.0], size=size)) == ("taken", None)
    assert agg.add(eval_group(2, "gsm8k", 0, [1.0, 0.0], size=size)) == ("duplicate", None)
    # ids of another round, of a training group, or of a group already received change nothing
    assert agg.add_failed(["e000004-gsm8k-00001", "0123abcd", "e000002-gsm8k-00000"]) == []
    assert agg.add_failed(["e000002-countdown-00001"]) == []  # 3 of 4
    decision, closed = agg.add(eval_group(2, "gsm8k", 1, [1.0, 1.0], size=size, version=(1, 2)))
    assert decision == "taken" and closed is not None and closed.round == 2
    assert closed.group_ids == ["e000002-countdown-00000", "e000002-gsm8k-00000", "e000002-gsm8k-00001"]
    by_task = {r.task: r for r in closed.results}
    assert sorted(by_task) == ["countdown", "gsm8k"]
    g = by_task["gsm8k"]
    assert (g.round, g.num_samples, g.num_failed, g.version_min, g.version_max) == (2, 4, 0, 1, 3)
    assert g.metrics["reward_mean"] == pytest.approx(0.75) and g.metrics["pass_at_2"] == 1.0
    assert g.metrics["completion_len_mean"] == pytest.approx((3 + 5 + 1 + 1) / 4)
    c = by_task["countdown"]
    assert (c.num_samples, c.num_failed, c.metrics["reward_mean"], c.metrics["pass_at_2"]) == (2, 1, 0.0, 0.0)
    back = decode(encode(g))
    assert isinstance(back, EvalResult) and back.metrics == g.metrics
    # after closing: anything of round 2 is late; the failure of round 4's group waits for round 4
    assert agg.add(eval_group(2, "gsm8k", 0, [1.0, 0.0], size=size)) == ("late", None)
    assert agg.add_failed(["e000002-gsm8k-00009"]) == []
    decision, closed4 = agg.add(eval_group(4, "gsm8k", 0, [0.0], size=2))
    assert decision == "taken" and closed4 is not None  # 1 received + the failure seen earlier = 2
    (r4,) = closed4.results
    assert (r4.round, r4.num_samples, r4.num_failed) == (4, 1, 1) and closed4.group_ids == ["e000004-gsm8k-00000"]


def test_a_task_whose_groups_all_failed_gets_an_empty_result():
    agg = EvalAggregator()
    assert agg.add(eval_group(0, "gsm8k", 0, [1.0], size=2)) == ("taken", None)
    (closed,) = agg.add_failed(["e000000-countdown-00000"])
    empty = next(r for r in closed.results if r.task == "countdown")
    assert (empty.num_samples, empty.num_failed, empty.metrics, empty.version_min, empty.version_max) == (
        0,
        1,
        {},
        0,
        0,
    )


def test_bad_eval_groups_are_refused():
    agg = EvalAggregator()
    with pytest.raises(ValueError, match="not an eval group"):
        agg.add(scored("t", [1], [[5]], rewards=[1.0]))
    agg.add(eval_group(1, "gsm8k", 0, [1.0], size=3))
    with pytest.raises(ValueError, match="round 1 has 2 groups, earlier ones said 3"):
        agg.add(eval_group(1, "gsm8k", 1, [1.0], size=2))
