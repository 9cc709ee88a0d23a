"""verifiers environments as rlbus tasks (tasks.verifiers_env) and tool calls on the producer's
OpenAI-compatible endpoint, with a real vLLM engine on CPU, the official ``openai`` client and the
real ``verifiers`` package: a single-turn and a multi-turn tool environment written in
tests/producers/vf_envs.py run through the agent machinery (producers.agents) and yield groups
whose rewards are the rubrics' scores and whose model tokens are what vLLM sampled.

The policy is the tiny random policy rewired so that every turn is one of two tokens, then
end-of-turn: "5" (the answer) or an added token whose text is a ``<tool_call>`` block calling
``add(a=2, b=3)`` (:func:`_scripted_policy`); both are sampled with probability 1/2 at
temperature 1, so an episode's turns and reward follow from its sampled tokens, which the test
reads back to compute the expected rubric score.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
pytest.importorskip("verifiers")

from bus.codec import decode, encode  # noqa: E402
from bus.messages import Prompt  # noqa: E402
from configs.rollout import TaskConfig  # noqa: E402
from producers.agents import AgentRunner  # noqa: E402
from producers.endpoint_episodes import EPISODE_HEADER, assemble_episode  # noqa: E402
from producers.episodes import env_turn_ids  # noqa: E402
from producers.proc import group_from_samples  # noqa: E402
from tasks.registry import get_task, load_task_examples  # noqa: E402
from tests.producers import vf_envs  # noqa: E402
from tests.producers.endpoint_serving import served_endpoint  # noqa: E402
from tests.producers.test_weight_sync import _hf_logprobs, _load_hf  # noqa: E402
from policies.tiny_model import IM_END_TOKEN_ID, build_random_policy  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SAMPLING = dict(temperature=1.0, top_p=1.0, max_tokens=8, min_tokens=0, repetition_penalty=1.0, seed=5)
TASK = "verifiers:tests.producers.vf_envs"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
LOGIT = 25.0  # the two answers' logit (EOS's after them); every other token's is 0


def _scripted_policy(policy, out):
    """The policy at ``policy`` with the tool-call token added and rewired (module docstring):
    attention and MLP outputs are zeroed, so the last hidden state is the current token's
    embedding; "\\n" (the end of the generation prompt), "5" and the tool-call token get
    orthogonal embeddings; the lm_head maps "\\n" to "5" or the tool call (logit ``LOGIT`` each)
    and those two to end-of-turn. Returns ``(out, tool_call_id, answer_id)``."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(policy)
    tok.add_tokens([AddedToken(vf_envs.TOOL_CALL, special=False, normalized=False)])
    tool_id = tok.convert_tokens_to_ids(vf_envs.TOOL_CALL)
    newline, answer = tok.encode("\n", add_special_tokens=False), tok.encode(vf_envs.ANSWER, add_special_tokens=False)
    assert len(newline) == len(answer) == 1 and tok.encode(vf_envs.TOOL_CALL, add_special_tokens=False) == [tool_id]
    model = _load_hf(policy)
    model.resize_token_embeddings(len(tok))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        scale = model.config.hidden_size**0.5  # RMSNorm maps a one-hot residual to sqrt(hidden) there
        for dim, token in enumerate((newline[0], answer[0], tool_id), start=1):
            emb[token].zero_()
            emb[token, dim] = 1.0
        unit = lambda dim: LOGIT / (scale * model.model.norm.weight[dim].item())
        head[answer[0], 1] = head[tool_id, 1] = unit(1)
        head[IM_END_TOKEN_ID, 2] = unit(2)
        head[IM_END_TOKEN_ID, 3] = unit(3)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, tool_id, answer[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(started endpoint, HF copy of its model, run(coro), tool-call token id, answer token id)."""
    tmp = tmp_path_factory.mktemp("verifiers")
    model_dir, tool_id, answer_id = _scripted_policy(build_random_policy(tmp / "policy", seed=0), tmp / "scripted")
    with served_endpoint(model_dir, 512) as (endpoint, run):
        yield endpoint, _load_hf(model_dir), run, tool_id, answer_id


def test_tool_calls_come_back_as_openai_tool_calls_and_continue_token_exactly(served):
    endpoint, _, _, tool_id, answer_id = served
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    # first turns until one is a tool call (each turn is the call or the answer with probability 1/2)
    for attempt in range(12):
        episode = f"tc-{attempt}"
        endpoint.episodes.open(episode, {**SAMPLING, "seed": attempt})
        client = openai.OpenAI(
            base_url=endpoint.url, api_key="x", default_headers={EPISODE_HEADER: episode}, max_retries=0
        )
        first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        if first.choices[0].message.tool_calls:
            break
        assert first.choices[0].message.content == vf_envs.ANSWER and first.choices[0].finish_reason == "stop"
        endpoint.episodes.close(episode)
    else:
        pytest.fail("no tool call in 12 first turns")
    choice = first.choices[0]
    call = choice.message.tool_calls[0]
    assert (
        choice.finish_reason == "tool_calls" and choice.message.content is None and len(choice.message.tool_calls) == 1
    )
    assert (
        call.type == "function"
        and call.function.name == "add"
        and json.loads(call.function.arguments) == {"a": 2, "b": 3}
    )
    # the assistant turn goes back as tool_calls (no text), followed by the tool's result
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"},
    ]
    client.chat.completions.create(model="m", messages=history, tools=TOOLS)
    turns = endpoint.episodes.close(episode)
    assert turns[0].sample.token_ids == [tool_id, IM_END_TOKEN_ID]
    env = env_turn_ids(endpoint.tokenizer, history[2:], tools=TOOLS)
    assert turns[1].prompt_ids == turns[0].prompt_ids + [tool_id, IM_END_TOKEN_ID] + env  # never re-tokenized
    prompt, ep, rebased = assemble_episode(turns)
    assert not rebased and ep.turns == 2 and ep.model_mask.count(False) == len(env)
    # without tools in the request the same text is plain content
    plain = openai.OpenAI(base_url=endpoint.url, api_key="x", max_retries=0)
    texts = {
        plain.chat.completions.create(model="m", messages=messages, seed=s).choices[0].message.content for s in range(8)
    }
    assert texts == {vf_envs.ANSWER, vf_envs.TOOL_CALL}


def _expected_reward(
    kind: str, token_ids: list[int], mask: list[bool], tool_id: int, answer_id: int, answer: str
) -> float:
    """The rubric's score of an episode, from its sampled tokens: its model turns are the first
    tokens of each span of model tokens."""
    firsts = [t for k, t in enumerate(token_ids) if mask[k] and (k == 0 or not mask[k - 1])]
    assert firsts and set(firsts) <= {tool_id, answer_id}
    correct = float(firsts[-1] == answer_id and answer == vf_envs.ANSWER)
    if kind == "single":
        return correct
    assert all(t == tool_id for t in firsts[:-1]) and len(firsts) <= vf_envs.MAX_TURNS
    return correct + vf_envs.USED_TOOL_WEIGHT * (len(firsts) > 1)


@pytest.mark.parametrize("kind", ["single", "tool"])
def test_verifiers_environment_groups_score_with_the_rubric_token_exactly(served, kind):
    endpoint, model, run, tool_id, answer_id = served
    task = get_task(TASK, TaskConfig(name=TASK, verifiers_args={"kind": kind}))
    assert task.rewards == () and task.agent == "tasks.verifiers_env:rollout"
    examples = load_task_examples(task, "train", 2, seed=0)
    runner = AgentRunner(endpoint, [task.agent], timeout_s=120.0, num_procs=2)
    turns_seen, rewards_seen = set(), set()
    try:
        for i, example in enumerate(examples):
            row = example["info"]["verifiers"]["row"]
            messages = [{"role": "user", "content": example["prompt"]}]
            prompt_ids = endpoint.tokenizer.encode(
                endpoint.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                add_special_tokens=False,
            )
            payload = {"messages": messages, "info": example["info"], "task": TASK}
            prompt, samples, masks, rewards = run(
                runner.run_group(task.agent, payload, prompt_ids, request_id=f"{kind}-{i}", n=4, **SAMPLING)
            )
            assert prompt == prompt_ids  # the environment's prompt is the row's, rendered by the chat template
            for s, mask, reward in zip(samples, masks, rewards):
                assert not s.finish_reason.startswith("env_error"), s.finish_reason
                assert reward == _expected_reward(kind, s.token_ids, mask, tool_id, answer_id, row["answer"])
                rewards_seen.add(reward)
                turns_seen.add(sum(1 for k, m in enumerate(mask) if m and (k == 0 or not mask[k - 1])))
                ref = _hf_logprobs(model, prompt, s.token_ids)  # the sampled logprobs are the policy's
                assert (ref - torch.tensor(s.logprobs))[torch.tensor(mask)].abs().max().item() < 1e-4
            group = group_from_samples(
                Prompt(id=f"{kind}-{i}", index=i, step=0, task=TASK, messages=messages, info=example["info"]),
                prompt,
                samples,
                [endpoint.tokenizer.decode(s.token_ids) for s in samples],
                producer="p0",
                gen_time_s=0.0,
                model_masks=masks,
                env_rewards=rewards,
            )
            group = decode(encode(group))  # a valid RolloutGroup on the wire, as the producer sends it
            assert group.env_rewards.tolist() == rewards and group.loss_mask.tolist() == [
                m for mask in masks for m in mask
            ]
            assert group.completion_ids.tolist() == [t for s in samples for t in s.token_ids]
    finally:
        runner.close()
    assert len(rewards_seen) > 1  # the rubric told episodes apart
    assert turns_seen == {1} if kind == "single" else len(turns_seen) > 1  # the tool env ran several turns
