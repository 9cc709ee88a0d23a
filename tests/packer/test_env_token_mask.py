"""Multi-turn groups through the reward worker and the packer: the environment's reward becomes the
term ``env``, and environment tokens (``RolloutGroup.loss_mask`` False) are context, never loss
tokens, while single-turn groups (empty ``loss_mask``) keep every completion token as a loss token."""

from __future__ import annotations

import numpy as np

from bus.messages import RolloutGroup
from packer.assemble import pack_groups
from rewards.worker import RewardWorker


def _group(loss_mask: list[bool], env_rewards: list[float]) -> RolloutGroup:
    # G = 2 samples of 4 and 2 completion tokens after a 3-token prompt
    return RolloutGroup(
        id="g-mt",
        prompt_index=0,
        step=0,
        task="reverse_turns",
        info={"words": ["abcde", "fghij"]},
        producer="producer-0",
        completion_texts=["ab<|im_end|>\nx", "cd"],
        finish_reasons=["stop", "env_error: timeout"],
        gen_time_s=0.1,
        prompt_ids=np.array([1, 2, 3], np.int32),
        completion_ids=np.array([10, 11, 12, 13, 14, 15], np.int32),
        completion_lens=np.array([4, 2], np.int32),
        sampler_logprobs=np.array([-0.5, 0, 0, -0.25, -1, -2], np.float32),
        version_start=np.zeros(2, np.int64),
        version_end=np.zeros(2, np.int64),
        loss_mask=np.array(loss_mask, bool),
        env_rewards=np.array(env_rewards, np.float32),
    )


def test_env_reward_is_the_env_term_and_env_tokens_are_not_loss_tokens():
    worker = RewardWorker({"reverse_turns": ()}, name="rewards-0", isolate=False)
    scored = worker.score(_group([True, False, False, True, True, True], [0.75, 0.0]))
    assert scored.reward_terms == {"env": [0.75, 0.0]}
    assert scored.rewards.tolist() == [0.75, 0.0] and scored.advantages[0] > 0 > scored.advantages[1]
    (mb,) = pack_groups([scored], 0, 64)
    assert mb.sample_ids == ["g-mt/0", "g-mt/1"] and mb.seq_lens.tolist() == [7, 5]
    assert mb.loss_mask[:7].tolist() == [False] * 3 + [True, False, False, True]
    assert mb.loss_mask[7:].tolist() == [False] * 3 + [True, True]
    assert mb.sampler_logprobs[4:6].tolist() == [0.0, 0.0]  # the env tokens' logprobs are 0


def test_single_turn_groups_keep_every_completion_token():
    worker = RewardWorker({"reverse_turns": ()}, name="rewards-0", isolate=False)
    scored = worker.score(_group([], []))
    assert scored.reward_terms == {} and scored.rewards.tolist() == [0.0, 0.0]
    (mb,) = pack_groups([scored], 0, 64)
    assert mb.sample_ids == ["g-mt/0", "g-mt/1"] and mb.seq_lens.tolist() == [7, 5]
    assert mb.loss_mask.tolist() == [False] * 3 + [True] * 4 + [False] * 3 + [True] * 2


def test_filters_judge_model_tokens_only():
    # environment tokens have logprob 0 (probability 1): a run of them must not look like repetition
    from configs.schema import FiltersConfig

    filters = FiltersConfig.model_validate({"repetition": {"enabled": True, "window": 2, "prob_threshold": 0.9}})
    worker = RewardWorker({"reverse_turns": ()}, name="rewards-0", isolate=False, filters=filters)
    scored = worker.score(_group([True, False, False, True, True, True], [0.75, 0.0]))
    assert list(scored.flags) == ["", ""]
    single = worker.score(_group([], [0.75, 0.0]))  # the same tokens as the model's: sample 0 repeats
    assert list(single.flags) == ["repetition", ""]
