"""Weight broadcast into a real vLLM engine on CUDA (broadcaster/dist_broadcast.py ->
broadcaster/worker_extension.py), the GPU twin of tests/producers/test_weight_sync.py.

The test process plays the trainer: it perturbs the tiny policy (every weight + N(0, 0.05)),
rounds it to bfloat16 (the engine's dtype, so both sides hold the same numbers) and broadcasts it
as version 1 into a vLLM engine running in bfloat16 on cuda:0. The engine's samples must then
report version 1 and their sampled-token logprobs must equal a float32 forward of the same
bf16-rounded weights to bf16 compute rounding (max 0.15 nats over the completion tokens: vLLM
computes in bf16, 8 mantissa bits; transformers in bf16 on the same weights was measured on CPU
at most 0.031 nats off float32 over 8 x 24 tokens), while differing from the old weights'
logprobs by much more (> 0.5 nats somewhere; 1.1 to 2.1 nats measured on CPU, same 8 x 24 tokens).

Backends: nccl (the trainer's send buffers on cuda:1, the engine on cuda:0: NCCL refuses two ranks
of a group on one device, so it needs 2 GPUs and is skipped with a message otherwise) and gloo
(host buffers; what a shared single-GPU run such as configs/gpu_smoke.yaml uses).
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
import torch

from tests.gpu.conftest import needs_gpus

PROMPT = list(range(65, 91))  # "ABC...Z" as byte tokens
LOGPROB_ATOL = 0.15
MIN_CHANGE_NATS = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.no_grad()
def hf_logprobs(model, completion: list[int]) -> torch.Tensor:
    """[len(completion)] log p(completion[i] | PROMPT + completion[:i]) under the float32 `model`."""
    ids = torch.tensor([PROMPT + completion])
    logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    positions = torch.arange(len(PROMPT) - 1, len(PROMPT) - 1 + len(completion))
    return logp[positions, torch.tensor(completion)]


def perturbed_bf16(path):
    """(float32 model holding bf16-rounded perturbed weights, the bf16 state dict to send)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
            p.copy_(p.to(torch.bfloat16).float())
    return model, {name: t.to(torch.bfloat16) for name, t in model.state_dict().items()}


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_broadcast_into_vllm_gpu_engine(backend, tmp_path):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from broadcaster.dist_broadcast import BroadcastSender
    from producers.engine import RolloutEngine
    from policies.tiny_model import build_random_policy

    # the sender's device: cuda:1 for nccl (the engine's worker uses cuda:0). The current CUDA
    # device is per thread, and the sender works on other threads: each sets it (`on_sender_device`)
    sender_device = 0
    if backend == "nccl":
        needs_gpus(2)
        sender_device = 1

    def on_sender_device(fn, *args):
        torch.cuda.set_device(sender_device)
        return fn(*args)

    policy = build_random_policy(tmp_path / "policy", seed=0)
    old = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32).eval()
    new, payload = perturbed_bf16(policy)
    loop = asyncio.new_event_loop()
    engine = RolloutEngine(
        policy,
        max_model_len=512,
        kv_cache_bytes=256 * 1024**2,
        engine_kwargs={"dtype": "bfloat16", "gpu_memory_utilization": 0.3},
    )
    sender = BroadcastSender(backend, "127.0.0.1", free_port(), 2, timeout_s=120)
    try:
        loop.run_until_complete(engine.start())
        joined = threading.Thread(target=on_sender_device, args=(sender.init_group,))
        joined.start()
        loop.run_until_complete(engine.init_weight_group("127.0.0.1", sender.port, 1, 2, backend, 120))
        joined.join(timeout=120)
        assert not joined.is_alive()

        async def send_and_receive():
            manifest = sender.manifest(payload)
            sent = asyncio.get_running_loop().run_in_executor(
                None, on_sender_device, sender.start_send, payload, 1, manifest
            )
            await engine.update_weights(1, manifest)
            await sent
            return await engine.generate_group(
                PROMPT, n=4, temperature=1.0, top_p=1.0, max_tokens=24, request_id="after", ignore_eos=True
            )

        samples = loop.run_until_complete(send_and_receive())
        assert sender.wait()["version"] == 1
        assert {(s.version_start, s.version_end) for s in samples} == {(1, 1)}
        errs = [(hf_logprobs(new, s.token_ids) - torch.tensor(s.logprobs)).abs().max().item() for s in samples]
        changes = [(hf_logprobs(old, s.token_ids) - torch.tensor(s.logprobs)).abs().max().item() for s in samples]
        assert max(errs) < LOGPROB_ATOL, f"engine logprobs off the sent weights by {max(errs):.3f} nats ({backend})"
        assert max(changes) > MIN_CHANGE_NATS, (
            f"engine logprobs moved only {max(changes):.3f} nats from the old weights"
        )
    finally:
        sender.close()
        loop.run_until_complete(engine.close())
        loop.close()
