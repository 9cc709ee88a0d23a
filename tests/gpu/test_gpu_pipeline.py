"""``busctl up`` on CUDA: configs/gpu_smoke.yaml on one GPU, and FSDP2 on NCCL over 2 GPUs.

(f) One GPU shared by the trainer (trainer.device cuda, bfloat16) and one vLLM producer
(producers.share_gpus_with_trainer, gpu_memory_utilization 0.3), weights by gloo broadcast: the run
finishes its 5 steps with finite losses, every step trained its batch on-policy tokens, and the
producer's logprobs of samples from the trainer's current weights match the trainer's to bf16
rounding (0.1 nats: both sides compute in bfloat16 with different kernels, vLLM's paged attention
against flash-attention varlen, so the per-token logprobs of a 259-token vocabulary differ by a few
bf16 ulps of the logits; float32 runs on CPU are held to 1e-3, tests/e2e/test_pipeline.py).

(d) trainer.data_parallel=2 trainer.parallel=fsdp on 2 GPUs (trainer.dp_backend nccl), the
producer sharing GPU 0: same checks. Skipped with a message when fewer than 2 GPUs are visible.
The 2-rank-vs-1-rank equality of FSDP2 is tested on CPU with gloo (tests/trainer/test_fsdp*.py);
this test runs the same code over NCCL on real devices.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.conftest import needs_gpus

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "gpu_smoke.yaml"
MAX_STEPS = 5
LOGPROB_ATOL = 0.1


def busctl_up(run_dir: Path, *overrides: str, timeout_s: float = 900) -> list[dict]:
    """Run ``busctl up configs/gpu_smoke.yaml`` to completion; returns the records of metrics.jsonl (the
    trainer's steps), then of eval.jsonl (the packer's eval rounds)."""
    cmd = [
        sys.executable,
        "-m",
        "busctl",
        "up",
        str(SMOKE),
        f"run_dir={run_dir}",
        f"model.cache_dir={run_dir.parent / 'cache'}",
        *overrides,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-6000:]
    return [
        json.loads(line)
        for name in ("metrics.jsonl", "eval.jsonl")
        for line in (run_dir / name).read_text().splitlines()
    ]


def check_steps(metrics: list[dict]) -> None:
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == list(range(1, MAX_STEPS + 1))
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in steps)
    assert all(m["num_loss_tokens"] > 0 for m in steps)
    on_policy = [m for m in steps if m["onpolicy_tokens"] > 0]
    assert on_policy, "no step trained samples of its own weights: did the weights reach the producer?"
    assert max(m["onpolicy_lp_diff_max"] for m in on_policy) < LOGPROB_ATOL
    evals = [m for m in metrics if "eval/reverse_text/reward_mean" in m]
    assert [e["step"] for e in evals] == [0, MAX_STEPS]


def test_gpu_smoke_config_one_shared_gpu(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    check_steps(busctl_up(tmp_path / "run", f"trainer.max_steps={MAX_STEPS}"))


def test_fsdp_two_ranks_on_nccl(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    needs_gpus(2)
    metrics = busctl_up(
        tmp_path / "run",
        f"trainer.max_steps={MAX_STEPS}",
        "trainer.data_parallel=2",
        "trainer.parallel=fsdp",
        "trainer.dp_backend=nccl",
        "trainer.gpus=[0,1]",
    )
    check_steps(metrics)
