"""bench/gpu.py: refuses without CUDA (exit status 2, a message saying why and naming
--cpu-smoke), and its --cpu-smoke mode runs every part (vLLM producer, trainer steps, weight
broadcast into the engine) end to end on CPU and reports positive, finite numbers.

The smoke run starts a real vLLM CPU engine: 122 s on the shared 2-core host at load average ~9
(2026-11-24), so it carries the `e2e` marker (real vLLM, slow) like the pipeline tests."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import peak_tflops

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", None) == 756.0
    assert peak_tflops("NVIDIA H200", None) == 989.0
    assert peak_tflops("NVIDIA H200", 500.0) == 500.0
    assert peak_tflops("cpu", None) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_refuses_without_cuda():
    proc = run_bench(timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr and "--cpu-smoke" in proc.stderr


@pytest.mark.e2e
def test_cpu_smoke_runs_every_part(tmp_path):
    pytest.importorskip("vllm")
    out = tmp_path / "gpu.json"
    proc = run_bench("--cpu-smoke", "--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["device"] == "cpu"
    assert results["producer"]["generated_tokens"] == results["producer"]["prompts"] * 8
    trainer = results["trainer"]
    assert trainer["tokens_per_step"] > 0 and trainer["tokens_per_s"] > 0 and math.isfinite(trainer["last_loss"])
    sync = results["weight_sync"]
    assert sync["backend"] == "gloo" and sync["bytes"] == 4 * trainer["params"] and len(sync["seconds"]) == 2
