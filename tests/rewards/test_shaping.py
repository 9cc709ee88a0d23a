"""Overlong reward shaping (DAPO eq. 13, rewards.shaping) and the zero-variance group filter on
shaped rewards: hand-computed examples through the real reward worker (real reward children for
one case), the real packer logic, and the run config."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_worker import rollout

from configs.rollout import OverlongConfig
from configs.schema import ConfigError, load_config
from packer.packer import DropReason, Packer
from rewards.shaping import overlong_section, overlong_zone_counts, soft_overlong_punishment
from rewards.worker import RewardWorker

REVERSE = {"reverse_text": (("reverse_text", 1.0),)}


def test_soft_overlong_punishment_by_hand():
    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, linear to -1 at 10, -1 past it.
    # 7 -> (6 - 7) / 4 = -0.25, 9 -> -3/4, 10 -> -4/4 = -1, 11 and 40 -> -1
    lens = np.array([0, 5, 6, 7, 9, 10, 11, 40], np.int32)
    got = soft_overlong_punishment(lens, max_tokens=10, buffer_tokens=4)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.25, -0.75, -1.0, -1.0, -1.0]
    assert overlong_zone_counts(lens, 10, 4) == {"soft": 3, "hard": 2}
    # a buffer as long as L_max punishes from the first token: 1 -> (0 - 1) / 8
    assert soft_overlong_punishment(np.array([1, 8]), 8, 8).tolist() == [-0.125, -1.0]


@pytest.mark.parametrize(
    "lens, max_tokens, buffer_tokens, match",
    [
        (np.array([1.5]), 10, 4, "integer"),
        (np.array([-1]), 10, 4, ">= 0"),
        (np.array([3]), 10, 11, "buffer_tokens <= max_tokens"),
        (np.array([3]), 10, 0, "1 <= buffer_tokens"),
    ],
)
def test_soft_overlong_punishment_rejects_bad_input(lens, max_tokens, buffer_tokens, match):
    with pytest.raises(ValueError, match=match):
        soft_overlong_punishment(lens, max_tokens, buffer_tokens)


def shaped_worker(penalty: float = 0.5, max_tokens: int = 8, buffer_tokens: int = 4, **kwargs) -> RewardWorker:
    overlong = OverlongConfig(buffer_tokens=buffer_tokens, penalty=penalty, max_tokens=max_tokens)
    return RewardWorker(REVERSE, advantage="drgrpo", name="w", isolate=False, overlong=overlong, **kwargs)


def with_lens(texts: list[str], lens: list[int], **fields) -> object:
    """A reverse_text group (target "olleh") whose samples have ``lens`` tokens."""
    group = rollout(texts)
    n = sum(lens)
    return dataclasses.replace(
        group,
        completion_lens=np.array(lens, np.int32),
        completion_ids=np.arange(n, dtype=np.int32),
        sampler_logprobs=np.full(n, -0.5, np.float32),
        **fields,
    )


def test_worker_adds_the_penalty_and_counts_it(metric):
    # task rewards: "olleh" 1.0, "oll" 2*3/(3+5) = 0.75, "" 0.0, "olleh" 1.0
    # L_max 8, L_cache 4, lens [3, 5, 8, 12] -> R = [0, -0.25, -1, -1]; penalty 0.5
    # rewards = [1.0, 0.75 - 0.125, 0 - 0.5, 1.0 - 0.5] = [1.0, 0.625, -0.5, 0.5]
    soft, hard = (
        metric("rlbus_rewards_overlong_total", zone="soft"),
        metric("rlbus_rewards_overlong_total", zone="hard"),
    )
    scored = shaped_worker().score(with_lens(["olleh", "oll", "", "olleh"], [3, 5, 8, 12]))
    assert scored.reward_terms["overlong"] == [0.0, -0.25, -1.0, -1.0]
    assert scored.reward_terms["reverse_text"] == [1.0, 0.75, 0.0, 1.0]
    assert scored.rewards.tolist() == [1.0, 0.625, -0.5, 0.5]
    # drgrpo: mean = 1.625 / 4 = 0.40625
    np.testing.assert_allclose(scored.advantages, [0.59375, 0.21875, -0.90625, 0.09375], atol=1e-7)
    assert metric("rlbus_rewards_overlong_total", zone="soft") - soft == 2  # 5 and 8 tokens
    assert metric("rlbus_rewards_overlong_total", zone="hard") - hard == 1  # 12 tokens


def test_environment_tokens_do_not_count_and_eval_groups_are_not_shaped():
    # sample 0: 10 tokens of which 4 are the environment's -> 6 model tokens -> R = (4 - 6) / 4 = -0.5
    # sample 1: 3 model tokens -> R = 0
    mask = np.array([True] * 3 + [False] * 4 + [True] * 3 + [True] * 3)
    group = with_lens(["olleh", "olleh"], [10, 3], loss_mask=mask)
    scored = shaped_worker(penalty=1.0).score(group)
    assert scored.reward_terms["overlong"] == [-0.5, 0.0]
    assert scored.rewards.tolist() == [0.5, 1.0]
    evaluated = shaped_worker(penalty=1.0).score(dataclasses.replace(group, eval_round=0, eval_size=1))
    assert "overlong" not in evaluated.reward_terms and evaluated.rewards.tolist() == [1.0, 1.0]


def test_isolated_worker_shapes_like_in_process():
    group = with_lens(["olleh", "oll", "", "olleh"], [3, 5, 8, 12])
    worker = shaped_worker(num_procs=1)
    isolated = RewardWorker(REVERSE, advantage="drgrpo", name="w", isolate=True, num_procs=1, overlong=worker.overlong)
    try:
        assert isolated.score(group).rewards.tolist() == worker.score(group).rewards.tolist() == [1.0, 0.625, -0.5, 0.5]
    finally:
        isolated.close()


def test_zero_variance_filter_sees_the_shaped_rewards(metric):
    # All four answers are right (task reward 1), so unshaped this group has zero variance.
    # Lens [2, 5, 6, 8], L_max 8, L_cache 4, penalty 1: R = [0, -0.25, -0.5, -1] -> rewards [1, 0.75, 0.5, 0]: kept.
    # Lens [2, 3, 4, 4]: all within L_max - L_cache = 4 -> rewards [1, 1, 1, 1]: dropped as equal_rewards.
    zero_variance = metric("rlbus_rewards_zero_variance_groups_total")
    worker = shaped_worker(penalty=1.0)
    varied = worker.score(dataclasses.replace(with_lens(["olleh"] * 4, [2, 5, 6, 8]), id="varied"))
    equal = worker.score(dataclasses.replace(with_lens(["olleh"] * 4, [2, 3, 4, 4]), id="equal"))
    assert varied.rewards.tolist() == [1.0, 0.75, 0.5, 0.0] and equal.rewards.tolist() == [1.0] * 4
    packer = Packer(
        prompts_per_step=1,
        max_off_policy_steps=4,
        micro_batch_tokens=64,
        filter_equal_rewards=True,
        online_difficulty_filtering=True,
    )
    assert packer.add(varied) == (True, "")
    assert packer.add(equal) == (False, DropReason.FILTERED_EQUAL_REWARDS)
    # without shaping the varied group would have been dropped too
    plain = RewardWorker(REVERSE, advantage="drgrpo", name="w", isolate=False).score(
        dataclasses.replace(with_lens(["olleh"] * 4, [2, 5, 6, 8]), id="plain")
    )
    assert packer.add(plain) == (False, DropReason.FILTERED_EQUAL_REWARDS)
    assert metric("rlbus_rewards_zero_variance_groups_total") - zero_variance == 2  # "equal" and "plain"


def test_worker_refuses_a_reward_named_overlong_and_an_unresolved_section():
    named = {"reverse_text": (("tests.rewards.trl_reward_fns:overlong", 1.0),)}
    with pytest.raises(ValueError, match="named 'overlong'"):
        RewardWorker(named, name="w", isolate=False, overlong=OverlongConfig(buffer_tokens=2, max_tokens=8))
    with pytest.raises(ValueError, match="needs max_tokens"):
        RewardWorker(REVERSE, name="w", isolate=False, overlong=OverlongConfig(buffer_tokens=2))


def test_config_resolves_max_tokens_and_checks_the_buffer():
    cfg = load_config(None, ["sampling.max_tokens=48", "rewards.overlong={buffer_tokens: 16, penalty: 0.5}"])
    section = overlong_section(cfg)
    assert (section.max_tokens, section.buffer_tokens, section.penalty) == (48, 16, 0.5)
    assert overlong_section(load_config(None, [])) is None
    own = overlong_section(
        load_config(None, ["sampling.max_tokens=48", "rewards.overlong={buffer_tokens: 4, max_tokens: 20}"])
    )
    assert own.max_tokens == 20
    with pytest.raises(ConfigError, match="buffer_tokens \\(64\\) exceeds its max_tokens \\(48\\)"):
        load_config(None, ["sampling.max_tokens=48", "rewards.overlong={buffer_tokens: 64}"])
    with pytest.raises(ConfigError, match="rewards.overlong.penalty"):
        load_config(None, ["rewards.overlong={buffer_tokens: 4, penalty: 0}"])
