"""TRL-style reward functions used as they are (tasks.trl_rewards): functions written as in TRL's
documentation (tests/rewards/trl_reward_fns.py) score groups through the real reward worker, in
process and in real reward children, with hand-computed rewards."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trl_reward_fns
import zmq
from test_worker import errors, rollout

from bus.codec import decode
from bus.messages import Prompt, RolloutGroup
from configs.schema import load_config
from producers.rollout_sample import Sample
from rewards.worker import RewardWorker
from tasks.registry import reward_spec
from tasks.rewards import reward_name
from tasks.task import render_messages
from tasks.trl_rewards import TrainerState, checked_rewards, split_trl_ref, trl_batch, trl_kwargs
from tests.bus.wire_frames import edited_frames, frames_of


def trl(fn: str, fmt: str = "trl") -> str:
    return f"{fmt}:{trl_reward_fns.__name__}:{fn}"


def worker(*terms: tuple[str, float], isolate: bool = False, max_steps: int = 0) -> RewardWorker:
    return RewardWorker(
        {"reverse_text": tuple(terms)}, advantage="drgrpo", name="w", isolate=isolate, num_procs=1, max_steps=max_steps
    )


def group(texts: list[str], lens: list[int], info: dict, **fields) -> object:
    """A group of ``texts`` whose samples have ``lens`` tokens (ids 0, 1, 2, ...)."""
    n = sum(lens)
    return dataclasses.replace(
        rollout(texts, info=info),
        completion_lens=np.array(lens, np.int32),
        completion_ids=np.arange(n, dtype=np.int32),
        sampler_logprobs=np.full(n, -0.5, np.float32),
        **fields,
    )


@pytest.mark.parametrize("isolate", [False, True])
def test_documented_standard_format_functions_score_by_hand(isolate):
    # reward_len = -|20 - chars|: 20 chars -> 0, "\boxed{2}" (9 chars) -> -11, "" -> -20
    # token_count = tokens: [3, 2, 1]; reward_func (ground_truth "2"): [0, 1, 0]
    # reward = 1 * reward_len + 0.5 * token_count + 2 * reward_func = [1.5, -8.0, -19.5]
    w = worker((trl("reward_len"), 1.0), (trl("token_count"), 0.5), (trl("reward_func"), 2.0), isolate=isolate)
    try:
        scored = w.score(group(["x" * 20, r"\boxed{2}", ""], [3, 2, 1], {"ground_truth": "2"}))
    finally:
        w.close()
    assert scored.reward_terms == {
        "reward_len": [0.0, -11.0, -20.0],
        "token_count": [3.0, 2.0, 1.0],
        "reward_func": [0.0, 1.0, 0.0],
    }
    assert scored.rewards.tolist() == [1.5, -8.0, -19.5]
    np.testing.assert_allclose(scored.advantages, [61 / 6, 2 / 3, -65 / 6], atol=1e-5)  # mean = -26 / 3


def test_conversational_format_gets_assistant_messages():
    good, bad = "<think>3 * 4 = 12</think><answer>12</answer>", "It is 12."
    scored = worker((trl("format_reward_func", "trl_conversational"), 1.0)).score(group([good, bad], [4, 2], {}))
    assert scored.rewards.tolist() == [1.0, 0.0]
    # the same function called in standard format indexes a str with "content": TypeError, each sample 0
    before = errors("TypeError")
    scored = worker((trl("format_reward_func"), 1.0)).score(group([good, bad], [4, 2], {}))
    assert scored.rewards.tolist() == [0.0, 0.0] and errors("TypeError") - before == 2


def wire_round_trip(group: RolloutGroup, drop: str | None = None) -> RolloutGroup:
    """``group`` encoded, sent over a real ZeroMQ PUSH/PULL pair and decoded; ``drop``: a header field
    left out, as an older sender that does not know it sends it."""
    frames = frames_of(group) if drop is None else edited_frames(group, lambda header: header.pop(drop))
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        for sock in (pull, push):
            sock.linger = 0
        pull.bind("inproc://rollouts")
        push.connect("inproc://rollouts")
        push.send_multipart(frames)
        assert pull.poll(5000), "the group never arrived"
        return decode(pull.recv_multipart(copy=False))
    finally:
        ctx.destroy(linger=0)


def test_conversational_prompts_are_the_groups_chat_messages():
    from producers.proc import group_from_samples  # imports torch: only here

    # reverses_the_question: 1 if the completion is the user's message reversed, + 0.5 for a system turn
    samples = [Sample([5, 6], [-0.5] * 2, "", "stop", 1, 1), Sample([7, 8, 9], [-0.5] * 3, "", "stop", 1, 1)]

    def produced(messages: list, texts: list[str], prompt_text: str) -> RolloutGroup:
        """The group a producer builds for a prompt of ``messages`` (a reverse_text prompt as rendered)."""
        prompt = Prompt(id="p-1", index=0, step=1, task="reverse_text", messages=messages, info={})
        return group_from_samples(
            prompt, [1, 2, 3], samples, texts, producer="producer-0", gen_time_s=0.1, prompt_text=prompt_text
        )

    messages = render_messages({"id": "e", "prompt": "hello", "info": {}}, "Reverse the text.")
    chat = produced(
        messages,
        ["olleh", "hello"],
        "<|im_start|>system\nReverse the text.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n",
    )
    # messages that cannot travel as chat messages (a content list): the rendered text becomes one user message
    parts = produced([{"role": "user", "content": [{"type": "text", "text": "word"}]}], ["drow", "word"], "word")
    w = worker((trl("reverses_the_question", "trl_conversational"), 1.0), isolate=True)  # JSON to a real child
    try:
        assert (
            wire_round_trip(chat).prompt_messages
            == messages
            == [{"role": "system", "content": "Reverse the text."}, {"role": "user", "content": "hello"}]
        )
        assert w.score(wire_round_trip(chat)).rewards.tolist() == [1.5, 0.5]
        assert wire_round_trip(parts).prompt_messages == []
        assert w.score(wire_round_trip(parts)).rewards.tolist() == [1.0, 0.0]
        # a group from a sender that knows no prompt_messages: the same fallback (the whole rendered text is the user's)
        old = dataclasses.replace(chat, completion_texts=["olleh", chat.prompt_text[::-1]])
        assert wire_round_trip(old, drop="prompt_messages").prompt_messages == []
        assert w.score(wire_round_trip(old, drop="prompt_messages")).rewards.tolist() == [0.0, 1.0]
    finally:
        w.close()


def test_none_is_zero_without_an_error_and_columns_come_from_info():
    # math_reward_func: +1 if "4" in the completion else -1, for task "math"; None (not applicable) otherwise
    w = worker((trl("math_reward_func"), 1.0))
    assert w.score(group(["4", "5"], [1, 1], {"task": "math"})).rewards.tolist() == [1.0, -1.0]
    before = sum(errors(e) for e in ("non_finite", "TypeError", "ValueError"))
    assert w.score(group(["4", "5"], [1, 1], {"task": "code"})).rewards.tolist() == [0.0, 0.0]
    assert sum(errors(e) for e in ("non_finite", "TypeError", "ValueError")) == before


def test_trainer_state_log_metric_and_async_functions():
    # curriculum = global_step / max_steps = step 3 of 12 -> 0.25; logs_metric: chars [2, 4], logs mean 3
    w = worker((trl("curriculum"), 1.0), (trl("logs_metric"), 1.0), (trl("async_len"), 10.0), max_steps=12)
    scored = w.score(group(["ab", "abcd"], [1, 1], {}))
    assert scored.reward_terms["curriculum"] == [0.25, 0.25]
    assert scored.reward_terms["async_len"] == [2.0, 4.0]
    assert scored.rewards.tolist() == [0.25 + 2 + 20, 0.25 + 4 + 40]  # the logged metric is not added
    assert scored.reward_terms["logs_metric/mean_chars"] == [3.0, 3.0]


@pytest.mark.parametrize("isolate", [False, True])
def test_a_wrong_number_of_rewards_fails_the_whole_group(isolate):
    w = worker((trl("one_reward"), 1.0), (trl("reward_len"), 1.0), isolate=isolate)
    before = errors("ValueError")
    try:
        scored = w.score(group(["x" * 19, "x" * 22, "x"], [1, 1, 1], {}))
    finally:
        w.close()
    assert scored.reward_terms["one_reward"] == [0.0, 0.0, 0.0]
    assert scored.rewards.tolist() == [-1.0, -2.0, -19.0]  # reward_len still scores
    assert errors("ValueError") - before == 3


def test_the_keyword_arguments_are_trls():
    batch = trl_batch(
        "<|im_start|>user\nhi",
        ["a", "bc"],
        [[5], [6, 7]],
        global_step=2,
        max_steps=9,
        prompt_messages=[{"role": "user", "content": "hi"}],
    )
    metrics: dict[str, list[float]] = {}
    kwargs = trl_kwargs("conversational", ["a", "bc"], {"ground_truth": "x", "prompts": "shadowed"}, batch, metrics)
    assert set(kwargs) == {
        "prompts",
        "completions",
        "completion_ids",
        "trainer_state",
        "log_metric",
        "log_extra",
        "ground_truth",
    }
    assert (
        kwargs["prompts"] == [[{"role": "user", "content": "hi"}]] * 2
    )  # a dataset column named "prompts" loses to the argument
    kwargs["prompts"][0][0]["content"] = "edited"  # one copy per completion, as TRL's batch rows are
    assert (
        kwargs["prompts"][1] == [{"role": "user", "content": "hi"}] and batch["prompt_messages"][0]["content"] == "hi"
    )
    assert trl_kwargs("standard", ["a", "bc"], {}, batch, {})["prompts"] == ["<|im_start|>user\nhi"] * 2
    assert kwargs["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "bc"}]]
    assert kwargs["completion_ids"] == [[5], [6, 7]] and kwargs["ground_truth"] == ["x", "x"]
    assert kwargs["trainer_state"] == TrainerState(global_step=2, max_steps=9)
    kwargs["log_metric"]("m", 2)
    kwargs["log_metric"]("m", 4)
    assert metrics == {"m": [2.0, 4.0]}


def test_references_and_config():
    assert split_trl_ref("trl:pkg.mod:fn") == ("standard", "pkg.mod:fn")
    assert split_trl_ref("trl_conversational:pkg.mod:fn") == ("conversational", "pkg.mod:fn")
    assert split_trl_ref("pkg.mod:fn") == (None, "pkg.mod:fn")
    assert reward_name(trl("reward_len")) == "reward_len"
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        reward_name("trl:reverse_text")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        worker((trl("missing"), 1.0))
    cfg = load_config(None, [f"task.rewards=[{{name: '{trl('reward_len')}', weight: 0.5}}]"])
    assert reward_spec(cfg)["reverse_text"] == ((trl("reward_len"), 0.5),)


def test_outputs_are_checked():
    assert checked_rewards(np.array([1.0, 2.5]), 2, "f") == [
        1.0,
        2.5,
    ]  # any sequence of numbers, as TRL's torch.tensor takes
    assert checked_rewards([None, True], 2, "f") == [None, 1.0]
    for bad, error in (
        ("ab", TypeError),
        ({"a": 1.0, "b": 2.0}, TypeError),
        (3.0, TypeError),
        (["x", 1.0], TypeError),
        ([1.0], ValueError),
    ):
        with pytest.raises(error, match="TRL-style reward f"):
            checked_rewards(bad, 2, "f")
