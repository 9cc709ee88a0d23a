"""Episode recording logic of the OpenAI-compatible endpoint without an engine
(producers.endpoint_episodes, producers.agents helpers, producers.endpoint request checks), with
the tiny byte-level chat tokenizer and hand-made engine samples: a continued chat keeps the
sampled ids (here one the text does not show: a sampled ``<|im_start|>``), assembly marks the
tokens between turns as environment tokens with the last model token's version, and a prompt that
does not extend the trajectory ends the episode."""

from __future__ import annotations

import pytest

from producers.agents import common_prefix, with_head
from producers.endpoint import BadRequest, sampling_of
from producers.endpoint_episodes import EndpointEpisodes, RecordedTurn, assemble_episode, chat_prompt_ids
from producers.rollout_sample import Sample
from producers.episodes import env_turn_ids
from policies.tiny_model import IM_END_TOKEN_ID, build_tokenizer

IM_START = 257
PROMPT = [{"role": "user", "content": "abc"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _sample(ids: list[int], version: int) -> Sample:
    return Sample(ids, [-0.5] * len(ids), "", "stop", version, version, (), (version,) * len(ids))


def _prompt(tok, messages) -> list[int]:
    return tok.encode(
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )


def test_a_continued_chat_extends_the_trajectory_with_the_sampled_ids(tok):
    sampled = [ord("h"), IM_START, ord("i"), IM_END_TOKEN_ID]  # the text the client saw is "hi"
    text = tok.decode(sampled, skip_special_tokens=True)
    assert text == "hi"
    first = RecordedTurn(_prompt(tok, PROMPT), _sample(sampled, 3), 3, PROMPT, text)
    follow = [{"role": "user", "content": "next"}]
    messages = PROMPT + [{"role": "assistant", "content": text}] + follow
    ids = chat_prompt_ids(tok, messages, first)
    assert ids == first.prompt_ids + sampled + env_turn_ids(tok, follow)
    assert ids != _prompt(tok, messages)  # re-rendering the text would drop the sampled <|im_start|>
    # a turn cut before its end-of-turn token is closed by one environment token
    cut = RecordedTurn(first.prompt_ids, _sample(sampled[:2], 3), 3, PROMPT, "h")
    ids = chat_prompt_ids(tok, PROMPT + [{"role": "assistant", "content": "h"}] + follow, cut)
    assert ids == first.prompt_ids + sampled[:2] + [IM_END_TOKEN_ID] + env_turn_ids(tok, follow)
    # an edited assistant text is rendered from scratch
    edited = PROMPT + [{"role": "assistant", "content": "ho"}] + follow
    assert chat_prompt_ids(tok, edited, first) == _prompt(tok, edited)


def test_assembly_interleaves_env_tokens_and_stops_at_a_rebased_turn(tok):
    p0 = _prompt(tok, PROMPT)
    s1, s2, s3 = [1, 2, IM_END_TOKEN_ID], [3, IM_END_TOKEN_ID], [4]
    env = [10, 11]
    turns = [
        RecordedTurn(p0, _sample(s1, 5), 5, None, ""),
        RecordedTurn(p0 + s1 + env, _sample(s2, 6), 6, None, ""),
        RecordedTurn(p0 + [9], _sample(s3, 6), 6, None, ""),
    ]  # does not extend the trajectory
    prompt, ep, rebased = assemble_episode(turns[:2])
    assert not rebased and prompt == p0 and ep.turns == 2
    assert ep.token_ids == s1 + env + s2
    assert ep.model_mask == [True] * 3 + [False] * 2 + [True] * 2
    assert ep.logprobs == [-0.5] * 3 + [0.0] * 2 + [-0.5] * 2
    assert ep.versions == [5, 5, 5, 5, 5, 6, 6]  # env tokens: the version of the last model token
    prompt, ep, rebased = assemble_episode(turns)
    assert rebased and ep.token_ids == s1 + env + s2 and ep.turns == 2
    assert assemble_episode([]) == ([], ep.__class__(), False)


def test_group_prompt_is_the_common_prefix_and_the_rest_leads_as_env_tokens():
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == [1, 2]
    assert common_prefix([]) == [] and common_prefix([[5]]) == [5]
    _, ep, _ = assemble_episode([RecordedTurn([1, 2, 3], _sample([7, 8], 2), 2, None, "")])
    full = with_head(ep, [3], 0)
    assert full.token_ids == [3, 7, 8] and full.model_mask == [False, True, True]
    assert full.logprobs == [0.0, -0.5, -0.5] and full.versions == [2, 2, 2] and full.turns == 1


def test_requests_are_checked_and_episodes_sample_with_the_run_settings():
    run = dict(temperature=1.0, top_p=0.9, max_tokens=12, seed=4)
    n, kwargs = sampling_of({"messages": [], "temperature": 0.1, "max_tokens": 50, "stop": "x"}, "chat", run)
    assert n == 1 and kwargs == {**run, "stop": ["x"]}  # the run's settings win; max_tokens may only be lowered
    assert sampling_of({"prompt": "a", "max_tokens": 5}, "completions", run)[1]["max_tokens"] == 5
    with pytest.raises(BadRequest, match="unsupported fields: best_of, echo"):
        sampling_of({"prompt": "a", "echo": True, "best_of": 2}, "completions", None)
    with pytest.raises(BadRequest, match="stream"):
        sampling_of({"messages": [], "stream": True}, "chat", None)
    with pytest.raises(BadRequest, match="n=1"):
        sampling_of({"messages": [], "n": 3}, "chat", run)
    episodes = EndpointEpisodes()
    episodes.open("e", run)
    with pytest.raises(ValueError, match="already open"):
        episodes.open("e", run)
    assert episodes.close("e") == [] and episodes.sampling("e") is None
    assert not episodes.record("e", RecordedTurn([1], _sample([2], 0), 0, None, ""))
