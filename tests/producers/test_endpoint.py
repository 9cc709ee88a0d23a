"""The producer's OpenAI-compatible endpoint (producers.endpoint) with a real vLLM engine on CPU and
the official ``openai`` client: an episode's recorded turns assemble into one trajectory that is
token-exact (the engine's sampled ids and logprobs, environment tokens from the chat template in
between, the mask on the model's tokens), a rewritten history is rebased (never re-tokenized), bad
requests get 400/404, and agent functions run isolated per sample (producers.agents).

The model is the EOS-prone tiny random policy of test_engine_sampling (turns end after a few
tokens); processed logprobs at temperature 1, as the producers run.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from producers.agents import AgentRunner  # noqa: E402
from producers.endpoint_episodes import ENDPOINT_EPISODES, EPISODE_HEADER, assemble_episode  # noqa: E402
from producers.episodes import ENV_ERRORS_TOTAL, env_turn_ids  # noqa: E402
from tests.producers.test_engine_sampling import _eos_prone  # noqa: E402
from tests.producers.endpoint_serving import served_endpoint  # noqa: E402
from tests.producers.test_weight_sync import _hf_logprobs, _load_hf  # noqa: E402
from policies.tiny_model import IM_END_TOKEN_ID, build_random_policy  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SAMPLING = dict(temperature=1.0, top_p=1.0, max_tokens=6, min_tokens=0, repetition_penalty=1.0, seed=11)
PROMPT = [{"role": "user", "content": "abcde"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(started endpoint, HF copy of its model, run(coro) on the endpoint's event loop)."""
    tmp = tmp_path_factory.mktemp("endpoint")
    model_dir = _eos_prone(build_random_policy(tmp / "policy", seed=0), tmp / "eos_prone")
    with served_endpoint(model_dir, 256) as (endpoint, run):
        yield endpoint, _load_hf(model_dir), run


def _client(endpoint, episode_id: str | None = None):
    headers = {EPISODE_HEADER: episode_id} if episode_id else None
    return openai.OpenAI(base_url=endpoint.url, api_key="x", default_headers=headers, max_retries=0)


def test_two_chat_turns_assemble_token_exactly(served):
    endpoint, model, _ = served
    tok = endpoint.tokenizer
    endpoint.episodes.open("ep-1", SAMPLING)
    client = _client(endpoint, "ep-1")
    messages = list(PROMPT)
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=6, logprobs=True, temperature=0.2)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "fghij"},
    ]
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=6, logprobs=True)
    turns = endpoint.episodes.close("ep-1")
    assert len(turns) == 2
    # the responses carry the recorded logprobs; the episode's sampling won over temperature=0.2
    for turn, resp in zip(turns, (first, second)):
        assert [c.logprob for c in resp.choices[0].logprobs.content] == pytest.approx(turn.sample.logprobs, abs=1e-6)
        assert resp.usage.completion_tokens == len(turn.sample.token_ids)
    rendered = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    assert turns[0].prompt_ids == tok.encode(rendered, add_special_tokens=False)

    complete_before = ENDPOINT_EPISODES.labels("complete")._value.get()
    prompt, ep, rebased = assemble_episode(turns)
    assert not rebased and ENDPOINT_EPISODES.labels("complete")._value.get() == complete_before + 1
    s1, s2 = turns[0].sample.token_ids, turns[1].sample.token_ids
    close = [] if s1 and s1[-1] == IM_END_TOKEN_ID else [IM_END_TOKEN_ID]
    env = close + env_turn_ids(tok, [{"role": "user", "content": "fghij"}])
    assert prompt == turns[0].prompt_ids
    assert ep.token_ids == s1 + env + s2
    assert ep.model_mask == [True] * len(s1) + [False] * len(env) + [True] * len(s2)
    assert ep.logprobs == turns[0].sample.logprobs + [0.0] * len(env) + turns[1].sample.logprobs
    assert turns[1].prompt_ids == prompt + s1 + env
    assert ep.turns == 2
    # the sampled logprobs are the policy's logprobs of the whole trajectory (what the trainer computes)
    ref = _hf_logprobs(model, prompt, ep.token_ids)
    mask = torch.tensor(ep.model_mask)
    assert (ref - torch.tensor(ep.logprobs))[mask].abs().max().item() < 1e-4


def test_rewritten_history_is_rebased_not_retokenized(served):
    endpoint, _, _ = served
    endpoint.episodes.open("ep-2", SAMPLING)
    client = _client(endpoint, "ep-2")
    first = client.chat.completions.create(model="m", messages=PROMPT)
    # the client sends back a different assistant text: the template's rendering cannot extend the trajectory
    edited = PROMPT + [
        {"role": "assistant", "content": first.choices[0].message.content + "zz"},
        {"role": "user", "content": "more"},
    ]
    client.chat.completions.create(model="m", messages=edited)
    turns = endpoint.episodes.close("ep-2")
    rebased_before = ENDPOINT_EPISODES.labels("rebased")._value.get()
    prompt, ep, rebased = assemble_episode(turns)
    assert rebased and ENDPOINT_EPISODES.labels("rebased")._value.get() == rebased_before + 1
    assert ep.token_ids == turns[0].sample.token_ids and ep.turns == 1  # ends before the rewritten turn


def test_completions_route_and_bad_requests(served):
    endpoint, _, _ = served
    client = _client(endpoint)
    out = client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=4, n=2, logprobs=1)
    assert len(out.choices) == 2 and all(len(c.logprobs.token_logprobs) >= 1 for c in out.choices)
    with pytest.raises(openai.BadRequestError, match="unsupported fields: frobnicate"):
        client.chat.completions.create(model="m", messages=PROMPT, extra_body={"frobnicate": 1})
    with pytest.raises(openai.NotFoundError, match="not open"):
        _client(endpoint, "no-such-episode").chat.completions.create(model="m", messages=PROMPT)
    endpoint.episodes.open("ep-3", SAMPLING)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        _client(endpoint, "ep-3").chat.completions.create(model="m", messages=PROMPT, n=2)
    assert endpoint.episodes.close("ep-3") == []


def test_agent_functions_run_isolated_per_sample(served):
    endpoint, model, run = served
    tok = endpoint.tokenizer
    prompt_ids = tok.encode(
        tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    agents = ["tests.producers.endpoint_agents:two_turn_agent", "tests.producers.endpoint_agents:raising_agent"]
    runner = AgentRunner(endpoint, agents, timeout_s=120.0, num_procs=2)
    example = {"messages": PROMPT, "info": {}, "task": "t"}
    try:
        prompt, samples, masks, rewards = run(
            runner.run_group(agents[0], example, prompt_ids, request_id="g1", n=3, **SAMPLING)
        )
        assert prompt == prompt_ids
        for s, mask, reward in zip(samples, masks, rewards):
            assert sum(mask) >= 2 and not all(mask)  # two model turns with environment tokens between
            assert reward in (0.0, 1.0)
            ref = _hf_logprobs(model, prompt, s.token_ids)
            m = torch.tensor(mask)
            assert (ref - torch.tensor(s.logprobs))[m].abs().max().item() < 1e-4
        raised_before = ENV_ERRORS_TOTAL.labels("RuntimeError")._value.get()
        _, samples, masks, rewards = run(
            runner.run_group(agents[1], example, prompt_ids, request_id="g2", n=2, **SAMPLING)
        )
        assert rewards == [0.0, 0.0] and all(s.finish_reason == "env_error: RuntimeError" for s in samples)
        assert all(sum(m) >= 1 for m in masks)  # the recorded turn is kept
        assert ENV_ERRORS_TOTAL.labels("RuntimeError")._value.get() == raised_before + 2
    finally:
        runner.close()
