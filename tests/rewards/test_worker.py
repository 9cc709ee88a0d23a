"""Tests for rewards.worker.RewardWorker.score: verifier rewards, group advantages, error policy."""

from __future__ import annotations

import math

import numpy as np
import pytest
import reward_fns
from prometheus_client import REGISTRY

from bus.messages import RolloutGroup, ScoredGroup, decode, encode
from rewards.worker import RewardWorker

# prompt "hello" -> target "olleh" (5 chars); reward = 2 * M / (len(completion) + len(target))
TEXTS = [
    "olleh",  # exact: 2*5/(5+5) = 1.0
    "",  # empty: 2*0/(0+5) = 0.0
    "oll",  # prefix: M = 3, 2*3/(3+5) = 0.75
    " xolleh <|im_end|>",  # cleaned "xolleh": M = 5, 2*5/(6+5) = 10/11
]
REWARDS = [1.0, 0.0, 0.75, 10 / 11]


def rollout(texts: list[str], info: dict | None = None) -> RolloutGroup:
    g = len(texts)
    lens = [max(len(t), 1) for t in texts]  # token counts are irrelevant to scoring
    n = sum(lens)
    return RolloutGroup(
        id="grp-1",
        prompt_index=7,
        step=3,
        task="reverse_text",
        info={"target": "olleh"} if info is None else info,
        producer="producer-0",
        completion_texts=list(texts),
        finish_reasons=["stop"] * g,
        gen_time_s=0.25,
        prompt_ids=np.arange(4, dtype=np.int32),
        completion_ids=np.arange(n, dtype=np.int32),
        completion_lens=np.array(lens, np.int32),
        logprobs=-np.linspace(0.1, 1.0, n, dtype=np.float32),
        version_start=np.array([1] * g, np.int64),
        version_end=np.array([2] * g, np.int64),
    )


def errors(name: str) -> float:
    return REGISTRY.get_sample_value("rlbus_rewards_errors_total", {"error": name}) or 0.0


def test_rewards_and_grpo_advantages_by_hand():
    eps = 1e-6
    scored = RewardWorker("reverse_text", advantage="grpo", eps=eps, name="rw-0", isolate=False).score(rollout(TEXTS))
    np.testing.assert_allclose(scored.rewards, REWARDS, rtol=0, atol=1e-7)
    assert scored.rewards.dtype == np.float32 and scored.advantages.dtype == np.float32
    # mean = (1 + 0 + 0.75 + 10/11) / 4 ; population std = sqrt(sum (r - mean)^2 / 4)
    r = [float(np.float32(x)) for x in REWARDS]  # the worker scores in float32
    mean = (r[0] + r[1] + r[2] + r[3]) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in r) / 4)
    expected = [(x - mean) / (std + eps) for x in r]
    np.testing.assert_allclose(scored.advantages, expected, rtol=1e-6, atol=1e-6)
    assert abs(float(scored.advantages.mean())) < 1e-6
    assert scored.advantages[0] > scored.advantages[3] > scored.advantages[2] > 0 > scored.advantages[1]


def test_mean_centred_advantages_without_std():
    scored = RewardWorker("reverse_text", advantage="drgrpo", eps=1e-6, name="rw-0", isolate=False).score(rollout(TEXTS))
    r = [float(np.float32(x)) for x in REWARDS]
    mean = sum(r) / 4  # ~0.664773
    np.testing.assert_allclose(scored.advantages, [x - mean for x in r], rtol=0, atol=1e-6)
    assert scored.advantages[1] == pytest.approx(-0.6647727, abs=1e-6)


def test_equal_rewards_give_zero_advantages():
    scored = RewardWorker("reverse_text", advantage="grpo", eps=1e-6, name="w", isolate=False).score(rollout(["olleh", "olleh<|endoftext|>"]))
    assert scored.rewards.tolist() == [1.0, 1.0]
    assert scored.advantages.tolist() == [0.0, 0.0]


def test_scored_group_keeps_rollout_fields_and_validates():
    group = rollout(TEXTS)
    scored = RewardWorker("reverse_text", advantage="grpo", eps=1e-6, name="rw-3", isolate=False).score(group)
    assert isinstance(scored, ScoredGroup) and scored.reward_worker == "rw-3"
    for name in ("id", "prompt_index", "step", "task", "info", "producer", "completion_texts", "finish_reasons", "gen_time_s"):
        assert getattr(scored, name) == getattr(group, name)
    for name in ("prompt_ids", "completion_ids", "completion_lens", "logprobs", "version_start", "version_end"):
        np.testing.assert_array_equal(getattr(scored, name), getattr(group, name))
    back = decode(encode(scored))
    assert isinstance(back, ScoredGroup) and back.reward_worker == "rw-3"
    np.testing.assert_array_equal(back.rewards, scored.rewards)
    np.testing.assert_array_equal(back.advantages, scored.advantages)
    # a RolloutGroup on the wire also decodes to what the worker can score
    np.testing.assert_array_equal(
        RewardWorker("reverse_text", advantage="grpo", eps=1e-6, name="w", isolate=False).score(decode(encode(group))).rewards, scored.rewards)


def test_raising_reward_function_scores_zero_and_is_counted():
    # reverse_text_reward raises TypeError when info has no str "target"
    before = errors("TypeError")
    worker = RewardWorker("reverse_text", advantage="grpo", eps=1e-6, name="w", isolate=False)
    scored = worker.score(rollout(["olleh", "x", "oll"], info={"answer": "olleh"}))
    assert scored.rewards.tolist() == [0.0, 0.0, 0.0]
    assert scored.advantages.tolist() == [0.0, 0.0, 0.0]
    assert errors("TypeError") - before == 3
    decode(encode(scored))  # still a valid message


@pytest.mark.parametrize("isolate", [False, True])
def test_some_samples_raise_others_score(isolate):
    # reward_fns.by_text: raises on "raise", NaN on "nan", else the text's length
    worker = RewardWorker(f"{reward_fns.__name__}:by_text", advantage="drgrpo", eps=1e-6, name="w", isolate=isolate)
    before = errors("ValueError"), errors("non_finite")
    try:
        scored = worker.score(rollout(["abcd", "raise", "nan", "ab"]))
    finally:
        worker.close()
    # rewards [4, 0, 0, 2], mean 1.5 -> advantages [2.5, -1.5, -1.5, 0.5]
    assert scored.rewards.tolist() == [4.0, 0.0, 0.0, 2.0]
    np.testing.assert_allclose(scored.advantages, [2.5, -1.5, -1.5, 0.5], atol=1e-7)
    assert (errors("ValueError") - before[0], errors("non_finite") - before[1]) == (1, 1)


def test_isolated_worker_scores_like_in_process():
    worker = RewardWorker("reverse_text", advantage="grpo", eps=1e-6, name="w", isolate=True, num_procs=2)
    try:
        isolated = worker.score(rollout(TEXTS))
    finally:
        worker.close()
    in_process = RewardWorker("reverse_text", advantage="grpo", eps=1e-6, name="w", isolate=False).score(rollout(TEXTS))
    np.testing.assert_array_equal(isolated.rewards, in_process.rewards)
    np.testing.assert_array_equal(isolated.advantages, in_process.advantages)


@pytest.mark.parametrize("isolate", [False, True])
def test_unknown_reward_name(isolate):
    with pytest.raises(ValueError, match="reverse_text"):
        RewardWorker("no_such_task", advantage="grpo", eps=1e-6, name="w", isolate=isolate)
