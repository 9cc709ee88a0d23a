"""Multi-turn episodes with a real vLLM engine on CPU (producers.episodes): each sample's trajectory
is exactly the model's sampled tokens interleaved with the chat template's rendering of the
environment turns, the mask marks the model's tokens, and the sampled logprobs of the model's tokens
are the policy's logprobs of the whole trajectory (what the trainer computes).

The model is the EOS-prone tiny random policy of test_engine_sampling (turns end after a few
tokens); the environment is reverse_turns' (real child processes, tasks.env.EnvCalls) with three
strings, so an episode has up to three model turns and two environment turns. Processed logprobs at
temperature 1, as the producers run.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("vllm")

from producers.engine import RolloutEngine
from producers.episodes import EpisodeRunner
from tasks.env import EnvCalls
from tests.producers.test_engine_sampling import _eos_prone
from tests.producers.test_weight_sync import _hf_logprobs, _load_hf, assert_no_leftover_processes
from policies.tiny_model import IM_END_TOKEN_ID, build_random_policy

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ENV = "tasks.reverse_turns:ReverseTurnsEnv"
WORDS = ["abcde", "fghijk", "lmnop"]
MARK = "\x01MODEL\x01"


def model_turns(token_ids, mask) -> list[list[int]]:
    """A trajectory's model turns: its runs of mask-1 tokens, in order (the last one may be empty)."""
    turns, cur = [], []
    for tid, m in zip(token_ids, mask):
        if m:
            cur.append(tid)
        elif cur:
            turns.append(cur)
            cur = []
    turns.append(cur)
    return turns


def test_episode_tokens_are_model_tokens_plus_template_rendered_env_turns(tmp_path):
    model_dir = _eos_prone(build_random_policy(tmp_path / "policy", seed=0), tmp_path / "eos_prone")
    loop = asyncio.new_event_loop()
    eng = RolloutEngine(
        model_dir, max_model_len=256, kv_cache_bytes=32 * 1024**2, engine_kwargs={"logprobs_mode": "processed_logprobs"}
    )
    envs = EnvCalls([ENV], timeout_s=10.0, num_procs=1)
    try:
        loop.run_until_complete(eng.start())
        tok = eng.tokenizer
        messages = [{"role": "user", "content": WORDS[0]}]
        prompt_ids = tok.encode(
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
        runner = EpisodeRunner(eng, tok, envs, max_model_len=256)
        samples, masks, rewards = loop.run_until_complete(
            runner.run_group(
                ENV,
                3,
                prompt_ids,
                {"words": WORDS},
                request_id="mt",
                n=4,
                temperature=1.0,
                top_p=1.0,
                max_tokens=6,
                min_tokens=0,
                repetition_penalty=1.0,
                seed=7,
            )
        )
        model = _load_hf(model_dir)
        turns_seen = set()
        for s, mask in zip(samples, masks):
            assert len(mask) == len(s.token_ids) == len(s.logprobs) == len(s.token_versions)
            turns = model_turns(s.token_ids, mask)
            turns_seen.add(len(turns))
            # the whole conversation rendered once by the template, model contents as markers
            convo = list(messages)
            for k in range(len(turns)):
                convo.append({"role": "assistant", "content": MARK})
                if k + 1 < len(turns):
                    convo.append({"role": "user", "content": WORDS[k + 1]})
            pieces = tok.apply_chat_template(convo, tokenize=False).split(MARK)
            expected = tok.encode(pieces[0], add_special_tokens=False)
            expected_mask = [False] * len(expected)
            for k, turn in enumerate(turns):
                body = turn[:-1] if turn[-1] == IM_END_TOKEN_ID else turn  # the template's <|im_end|> closes it
                expected += body
                expected_mask += [True] * len(body)
                if k + 1 < len(turns):
                    env_ids = tok.encode(pieces[k + 1], add_special_tokens=False)
                    if turn[-1] == IM_END_TOKEN_ID:  # the sampled EOS is the model's token
                        expected += [IM_END_TOKEN_ID]
                        expected_mask += [True]
                        env_ids = env_ids[1:]
                    expected += env_ids
                    expected_mask += [False] * len(env_ids)
                elif turn[-1] == IM_END_TOKEN_ID:
                    expected += [IM_END_TOKEN_ID]
                    expected_mask += [True]
            assert prompt_ids + s.token_ids == expected
            assert mask == expected_mask[len(prompt_ids) :]
            lps = torch.tensor(s.logprobs)
            m = torch.tensor(mask)
            assert (lps[~m] == 0).all()
            ref = _hf_logprobs(model, prompt_ids, s.token_ids)
            assert (ref - lps)[m].abs().max().item() < 1e-4  # the model's tokens, scored in full context
        assert max(turns_seen) >= 2, f"no episode reached a second model turn: {turns_seen}"
        assert all(0.0 <= r <= 1.0 for r in rewards)
    finally:
        envs.close()
        loop.run_until_complete(eng.close())
        loop.close()
        assert_no_leftover_processes()
