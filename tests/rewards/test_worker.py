"""Tests for rewards.worker.RewardWorker.score: weighted verifier rewards per task, filters, group
advantages, error policy (real reward functions, real child processes when isolated)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import reward_fns
from prometheus_client import REGISTRY

from bus.codec import decode, encode
from bus.messages import RolloutGroup, ScoredGroup
from configs.schema import FiltersConfig
from rewards.worker import RewardWorker

REVERSE = {"reverse_text": (("reverse_text", 1.0),)}
TIMEOUT_S = 0.5

# prompt "hello" -> target "olleh" (5 chars); reward = 2 * M / (len(completion) + len(target))
TEXTS = [
    "olleh",  # exact: 2*5/(5+5) = 1.0
    "",  # empty: 2*0/(0+5) = 0.0
    "oll",  # prefix: M = 3, 2*3/(3+5) = 0.75
    " xolleh <|im_end|>",  # cleaned "xolleh": M = 5, 2*5/(6+5) = 10/11
]
REWARDS = [1.0, 0.0, 0.75, 10 / 11]


def ref(fn: str) -> str:
    return f"{reward_fns.__name__}:{fn}"


def rollout(
    texts: list[str], info: dict | None = None, task: str = "reverse_text", logprobs: np.ndarray | None = None
) -> RolloutGroup:
    g = len(texts)
    lens = [max(len(t), 1) for t in texts]  # token counts are irrelevant to scoring
    n = sum(lens)
    return RolloutGroup(
        id="grp-1",
        prompt_index=7,
        step=3,
        task=task,
        info={"target": "olleh"} if info is None else info,
        producer="producer-0",
        completion_texts=list(texts),
        finish_reasons=["stop"] * g,
        gen_time_s=0.25,
        prompt_ids=np.arange(4, dtype=np.int32),
        completion_ids=np.arange(n, dtype=np.int32),
        completion_lens=np.array(lens, np.int32),
        sampler_logprobs=-np.linspace(0.1, 1.0, n, dtype=np.float32) if logprobs is None else logprobs,
        version_start=np.array([1] * g, np.int64),
        version_end=np.array([2] * g, np.int64),
    )


def errors(name: str) -> float:
    return REGISTRY.get_sample_value("rlbus_rewards_errors_total", {"error": name}) or 0.0


def filtered(name: str) -> float:
    return REGISTRY.get_sample_value("rlbus_rewards_filtered_total", {"filter": name}) or 0.0


def test_rewards_and_grpo_advantages_by_hand():
    eps = 1e-6
    scored = RewardWorker(REVERSE, advantage="grpo", eps=eps, name="rw-0", isolate=False).score(rollout(TEXTS))
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
    scored = RewardWorker(REVERSE, advantage="drgrpo", eps=1e-6, name="rw-0", isolate=False).score(rollout(TEXTS))
    r = [float(np.float32(x)) for x in REWARDS]
    mean = sum(r) / 4  # ~0.664773
    np.testing.assert_allclose(scored.advantages, [x - mean for x in r], rtol=0, atol=1e-6)
    assert scored.advantages[1] == pytest.approx(-0.6647727, abs=1e-6)


def test_equal_rewards_give_zero_advantages():
    scored = RewardWorker(REVERSE, advantage="grpo", eps=1e-6, name="w", isolate=False).score(
        rollout(["olleh", "olleh<|endoftext|>"])
    )
    assert scored.rewards.tolist() == [1.0, 1.0]
    assert scored.advantages.tolist() == [0.0, 0.0]


def test_scored_group_keeps_rollout_fields_and_validates():
    group = rollout(TEXTS)
    scored = RewardWorker(REVERSE, advantage="grpo", eps=1e-6, name="rw-3", isolate=False).score(group)
    assert isinstance(scored, ScoredGroup) and scored.reward_worker == "rw-3"
    for name in (
        "id",
        "prompt_index",
        "step",
        "task",
        "info",
        "producer",
        "completion_texts",
        "finish_reasons",
        "gen_time_s",
    ):
        assert getattr(scored, name) == getattr(group, name)
    for name in ("prompt_ids", "completion_ids", "completion_lens", "sampler_logprobs", "version_start", "version_end"):
        np.testing.assert_array_equal(getattr(scored, name), getattr(group, name))
    back = decode(encode(scored))
    assert isinstance(back, ScoredGroup) and back.reward_worker == "rw-3"
    np.testing.assert_array_equal(back.rewards, scored.rewards)
    np.testing.assert_array_equal(back.advantages, scored.advantages)
    # a RolloutGroup on the wire also decodes to what the worker can score
    np.testing.assert_array_equal(
        RewardWorker(REVERSE, advantage="grpo", eps=1e-6, name="w", isolate=False).score(decode(encode(group))).rewards,
        scored.rewards,
    )


def test_raising_reward_function_scores_zero_and_is_counted():
    # reverse_text_reward raises TypeError when info has no str "target"
    before = errors("TypeError")
    worker = RewardWorker(REVERSE, advantage="grpo", eps=1e-6, name="w", isolate=False)
    scored = worker.score(rollout(["olleh", "x", "oll"], info={"answer": "olleh"}))
    assert scored.rewards.tolist() == [0.0, 0.0, 0.0]
    assert scored.advantages.tolist() == [0.0, 0.0, 0.0]
    assert errors("TypeError") - before == 3
    decode(encode(scored))  # still a valid message


@pytest.mark.parametrize("isolate", [False, True])
def test_some_samples_raise_others_score(isolate):
    # reward_fns.by_text: raises on "raise", NaN on "nan", else the text's length
    worker = RewardWorker(
        {"reverse_text": ((ref("by_text"), 1.0),)}, advantage="drgrpo", eps=1e-6, name="w", isolate=isolate
    )
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
    worker = RewardWorker(REVERSE, advantage="grpo", eps=1e-6, name="w", isolate=True, num_procs=2)
    try:
        isolated = worker.score(rollout(TEXTS))
    finally:
        worker.close()
    in_process = RewardWorker(REVERSE, advantage="grpo", eps=1e-6, name="w", isolate=False).score(rollout(TEXTS))
    np.testing.assert_array_equal(isolated.rewards, in_process.rewards)
    np.testing.assert_array_equal(isolated.advantages, in_process.advantages)


@pytest.mark.parametrize("isolate", [False, True])
def test_unknown_reward_name(isolate):
    with pytest.raises(ValueError, match="reverse_text"):
        RewardWorker({"t": (("no_such_reward", 1.0),)}, advantage="grpo", eps=1e-6, name="w", isolate=isolate)


def test_reward_is_the_weighted_sum_of_the_terms():
    # reward = 2 * reverse_text - 0.1 * length; reverse_text scores REWARDS, length = len(text)
    spec = {"reverse_text": (("reverse_text", 2.0), (ref("length"), -0.1))}
    scored = RewardWorker(spec, advantage="drgrpo", name="w", isolate=False).score(rollout(TEXTS))
    lengths = [float(len(t)) for t in TEXTS]
    assert scored.reward_terms == {"reverse_text": REWARDS, "length": lengths}
    np.testing.assert_allclose(scored.rewards, [2 * r - 0.1 * n for r, n in zip(REWARDS, lengths)], rtol=1e-6)
    np.testing.assert_allclose(scored.advantages, scored.rewards - scored.rewards.mean(), atol=1e-6)
    back = decode(encode(scored))
    assert back.reward_terms == scored.reward_terms and back.flags == [] and back.masked.shape == (0,)


def test_each_task_is_scored_with_its_own_rewards():
    # one worker for the training task and an eval task with another reward
    spec = {**REVERSE, "lengths": ((ref("length"), 1.0),)}
    worker = RewardWorker(spec, advantage="drgrpo", name="w", isolate=False)
    assert worker.score(rollout(["olleh", "ol"], task="lengths")).rewards.tolist() == [5.0, 2.0]
    assert worker.score(rollout(["olleh", "ol"])).rewards.tolist() == [1.0, pytest.approx(4 / 7)]


def test_unknown_task_scores_zero_and_is_counted():
    before = errors("unknown_task")
    worker = RewardWorker(REVERSE, advantage="grpo", name="w", isolate=False)
    scored = worker.score(rollout(["olleh", "x", "oll"], task="gsm8k"))
    assert scored.rewards.tolist() == [0.0] * 3 and scored.advantages.tolist() == [0.0] * 3
    assert scored.reward_terms == {}
    assert errors("unknown_task") - before == 3


def test_skip_verification_calls_no_reward_function():
    # by_text would raise on "raise" and hang on "sleep": with skip_verification nothing runs
    before = errors("ValueError"), errors("timeout")
    worker = RewardWorker(
        {"reverse_text": ((ref("by_text"), 1.0),)},
        advantage="grpo",
        name="w",
        timeout_s=TIMEOUT_S,
        filters=FiltersConfig(skip_verification=True),
    )
    try:
        assert worker.scorer is None  # no child process started at all
        scored = worker.score(rollout(["raise", "sleep", "ab"]))
    finally:
        worker.close()
    assert scored.rewards.tolist() == [0.0] * 3 and scored.reward_terms == {}
    assert (errors("ValueError"), errors("timeout")) == before


def test_filters_flag_and_mask_without_moving_rewards():
    # three 5-token samples: a loop (all near-certain), a rare improbable token, a normal one
    sure, unsure = -0.001, -3.0
    logprobs = np.array([sure] * 5 + [unsure, -30.0, unsure, unsure, unsure] + [unsure] * 5, np.float32)
    group = rollout(["olleh", "xxxxx", "oll.."], logprobs=logprobs)
    group = dataclasses.replace(group, completion_ids=np.array([1] * 6 + [258] + [1] * 8, np.int32))
    cfg = FiltersConfig.model_validate(
        {
            "gibberish": {"enabled": True, "enforce": False, "token_id_threshold": 256, "logprob_threshold": -12.0},
            "repetition": {"enabled": True, "enforce": True, "window": 4, "prob_threshold": 0.99},
        }
    )
    before = filtered("gibberish"), filtered("repetition")
    scored = RewardWorker(REVERSE, advantage="drgrpo", name="w", isolate=False, filters=cfg).score(group)
    unfiltered = RewardWorker(REVERSE, advantage="drgrpo", name="w", isolate=False).score(group)
    assert scored.flags == ["repetition", "gibberish", ""]
    assert scored.masked.tolist() == [True, False, False]  # gibberish is not enforced: counted only
    assert (filtered("gibberish") - before[0], filtered("repetition") - before[1]) == (1, 1)
    np.testing.assert_array_equal(scored.rewards, unfiltered.rewards)  # the baseline keeps every reward
    np.testing.assert_array_equal(scored.advantages, unfiltered.advantages)
    assert unfiltered.flags == [] and unfiltered.masked.shape == (0,)
    back = decode(encode(scored))
    assert back.flags == scored.flags and back.masked.tolist() == [True, False, False]


def test_two_functions_of_one_task_need_distinct_names():
    with pytest.raises(ValueError, match="length"):
        RewardWorker({"t": ((ref("length"), 1.0), ("other_module:length", 1.0))}, name="w", isolate=False)


def test_hung_and_raising_terms_are_zeroed_alone_and_counted():
    """The issue's test: a reward function that sleeps past its timeout and one that raises, in a
    group scored by a real isolated worker with several weighted functions: the worker survives,
    only the failing terms score 0, and the reasons are counted."""
    # by_text hangs on "sleep", raises on "raise", else len(text); length never fails
    spec = {"t": ((ref("by_text"), 1.0), (ref("length"), 0.5))}
    before = errors("timeout"), errors("ValueError")
    worker = RewardWorker(spec, advantage="drgrpo", name="w", timeout_s=TIMEOUT_S, num_procs=2)
    try:
        scored = worker.score(rollout(["sleep", "raise", "ab"], task="t"))
        assert scored.reward_terms == {"by_text": [0.0, 0.0, 2.0], "length": [5.0, 5.0, 2.0]}
        assert scored.rewards.tolist() == [2.5, 2.5, 3.0]  # 1.0 * by_text + 0.5 * length
        assert (errors("timeout") - before[0], errors("ValueError") - before[1]) == (1, 1)
        # the worker lives on, with every child alive
        assert worker.score(rollout(["abc"], task="t")).rewards.tolist() == [4.5]
        assert len(worker.scorer.pids()) == 2
    finally:
        worker.close()


def test_a_fresh_process_exposes_every_filter_series_at_0():
    # a fresh interpreter, as a reward worker starts: no filter enabled, nothing scored yet
    import subprocess
    import sys

    from rewards.filters import FILTER_NAMES

    code = (
        "from prometheus_client import REGISTRY\n"
        "import rewards.worker\n"
        f"for name in {FILTER_NAMES!r}:\n"
        "    print(name, REGISTRY.get_sample_value('rlbus_rewards_filtered_total', {'filter': name}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == [word for name in FILTER_NAMES for word in (name, "0.0")]
