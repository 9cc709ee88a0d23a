"""Teacher logprobs with a real vLLM engine (producers.teacher.Teacher) against a HF forward.

The teacher is a perturbed copy of the tiny policy saved to a temporary directory. Completions
are fixed random token ids, so most tokens are NOT the teacher's top-1: the scores must be the
logprob of the token actually in the sequence, not of the teacher's favourite. Expected values:
`log_softmax(teacher(prompt + completion).logits)` at the completion's positions (float32;
tolerance 1e-4 nats, as the weight-sync tests).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from producers.teacher import Teacher
from tests.producers.test_weight_sync import (
    LOGPROB_ATOL,
    PROMPT,
    _hf_logprobs,
    _load_hf,
    _perturbed,
    assert_no_leftover_processes,
)
from policies.tiny_model import build_random_policy

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """(started Teacher, HF copy of the teacher model, its event loop)."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("teacher")
    policy = build_random_policy(tmp / "policy", seed=0)
    model = _perturbed(policy, seed=7)
    model.save_pretrained(tmp / "teacher")
    AutoTokenizer.from_pretrained(policy).save_pretrained(tmp / "teacher")
    loop = asyncio.new_event_loop()
    t = Teacher(tmp / "teacher", max_model_len=128, kv_cache_bytes=32 * 1024**2)
    try:
        loop.run_until_complete(t.start())
        yield t, _load_hf(tmp / "teacher"), loop
    finally:
        loop.run_until_complete(t.close())
        loop.close()
        assert_no_leftover_processes()


def test_teacher_logprobs_match_hf_forward(teacher):
    t, model, loop = teacher
    gen = torch.Generator().manual_seed(3)
    completions = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 0, 17)]
    got = loop.run_until_complete(t.score_group(PROMPT, completions, request_id="g0"))
    assert got.dtype == np.float32 and got.shape == (26,)
    offset, not_top1 = 0, 0
    for c in completions:
        if not c:
            continue
        ref = _hf_logprobs(model, PROMPT, c)
        assert np.abs(got[offset : offset + len(c)] - ref.numpy()).max() < LOGPROB_ATOL
        # how many scored tokens are not the teacher's argmax at their position
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + c])).logits[0, len(PROMPT) - 1 : -1]
        not_top1 += int((logits.argmax(-1) != torch.tensor(c)).sum())
        offset += len(c)
    assert not_top1 >= 20, "the check needs tokens that are not the teacher's top-1"


def test_completion_filling_the_policy_context_is_scored(teacher):
    """prompt + completion == the policy's max_model_len (128): still scored (teacher's is 129)."""
    t, model, loop = teacher
    completion = list(range(100, 100 + 128 - len(PROMPT)))
    got = loop.run_until_complete(t.score_group(PROMPT, [completion], request_id="full"))
    ref = _hf_logprobs(model, PROMPT, completion)
    assert got.shape == (len(completion),)
    assert np.abs(got - ref.numpy()).max() < LOGPROB_ATOL


def test_empty_completion_and_bad_input(teacher):
    t, _, loop = teacher
    assert loop.run_until_complete(t.engine.score_completion(PROMPT, [], request_id="e")) == []
    assert loop.run_until_complete(t.score_group(PROMPT, [[], []], request_id="e2")).shape == (0,)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        loop.run_until_complete(t.engine.score_completion([], [1, 2], request_id="bad"))
    with pytest.raises(ValueError, match="model_path"):
        Teacher("", max_model_len=16, kv_cache_bytes=1)
