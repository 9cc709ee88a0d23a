"""bench/gpu_trainer.py: refuses without CUDA (exit status 2, naming --cpu-smoke), and its
--cpu-smoke mode runs rlbus's trainer and the plain HF step on the same uniform and GRPO-shaped
samples on CPU, with finite losses, positive throughput and each row's ratio to the HF step."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_trainer import make_groups, samples_of

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "bench.gpu_trainer", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for hosts without CUDA")
def test_refuses_without_cuda():
    proc = run_bench()
    assert proc.returncode == 2 and "--cpu-smoke" in proc.stderr


def test_grpo_batch_is_groups_of_one_prompt():
    import numpy as np

    groups = make_groups("grpo", 512, smoke=False, rng=np.random.default_rng(0))
    assert len(groups) == 8 and all(g.group_size == 8 for g in groups)
    for g in groups:  # one prompt per group: the packer lays it before each completion
        assert len(g.prompt_ids) == 256
        assert all(32 <= int(n) <= 1024 for n in g.completion_lens)
    samples = samples_of(groups)
    assert all(np.array_equal(ids[:256], samples[8 * (i // 8)][0][:256]) for i, (ids, _, _) in enumerate(samples))
    assert all(32 <= int(mask.sum()) <= 1024 for _, mask, _ in samples)
    uniform = samples_of(make_groups("uniform", 512, smoke=False, rng=np.random.default_rng(0)))
    assert len(uniform) == 64 and {len(ids) for ids, _, _ in uniform} == {512}


def test_cpu_smoke(tmp_path: Path):
    out = tmp_path / "rows.json"
    proc = run_bench("--cpu-smoke", "--steps", "2", "--variants", "default,no_share,head_bf16", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["batch"], r["variant"]) for r in rows} == {
        (b, v) for b in ("uniform", "grpo") for v in ("hf", "default", "no_share", "head_bf16")
    }
    for r in rows:
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["vs_hf"] > 0
    assert "| grpo | default |" in proc.stdout
