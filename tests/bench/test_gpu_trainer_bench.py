"""bench/gpu_trainer.py: refuses without CUDA (exit status 2, naming --cpu-smoke); its batches (fixed,
and the step sequence with new counts and lengths per step); its TRL-shaped baselines' gradients equal
the plain policy gradient's direction; and --cpu-smoke runs rlbus's trainer and the baselines in both
modes on CPU, saying which baseline ran TRL's/Liger's own functions and which was skipped (trl and
liger-kernel are in the bench extra, not in the CI lock: then trl_logits runs this bench's own code)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.gpu_trainer_batches import make_groups, samples_of, step_batches

REPO = Path(__file__).resolve().parents[2]
HAVE = {
    "trl": importlib.util.find_spec("trl") is not None,
    "liger": importlib.util.find_spec("liger_kernel") is not None,
}


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
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
    groups = make_groups("grpo", 512, smoke=False, rng=np.random.default_rng(0))
    assert len(groups) == 8 and all(g.group_size == 8 for g in groups)
    for g in groups:  # one prompt per group: the packer lays it before each completion
        assert len(g.prompt_ids) == 256
        assert all(32 <= int(n) <= 1024 for n in g.completion_lens)
    samples = samples_of(groups)
    assert sum(len(ids) for ids, _, _ in samples) == 50797  # the batch of the runs in bench/README.md
    assert all(np.array_equal(ids[:256], samples[8 * (i // 8)][0][:256]) for i, (ids, _, _) in enumerate(samples))
    assert all(32 <= int(mask.sum()) <= 1024 for _, mask, _ in samples)
    uniform = samples_of(make_groups("uniform", 512, smoke=False, rng=np.random.default_rng(0)))
    assert len(uniform) == 64 and {len(ids) for ids, _, _ in uniform} == {512}


def test_step_sequence_draws_new_counts_and_lengths():
    fixed = step_batches("grpo", 512, False, 3, sequence=False)
    assert len(fixed) == 4 and all(b is fixed[0] for b in fixed)
    for kind in ("grpo", "uniform"):
        seq = step_batches(kind, 512, False, 6, sequence=True, seed=3)
        again = step_batches(kind, 512, False, 6, sequence=True, seed=3)
        counts = [len(samples_of(b)) for b in seq]
        assert counts == [len(samples_of(b)) for b in again]  # seeded: every variant sees the same steps
        assert len(set(counts)) > 1  # sample counts change between steps
    grpo = step_batches("grpo", 512, False, 6, sequence=True, seed=3)
    lengths = [sorted(len(ids) for ids, _, _ in samples_of(b)) for b in grpo]
    assert len({tuple(x) for x in lengths}) == len(grpo)  # and the lengths
    assert all(48 <= len(samples_of(b)) <= 80 and len(samples_of(b)) % 8 == 0 for b in grpo)
    assert len({len(g.prompt_ids) for b in grpo for g in b}) > 1  # prompt lengths drawn per group
    uniform = step_batches("uniform", 512, False, 6, sequence=True, seed=3)
    assert all(48 <= len(samples_of(b)) <= 80 for b in uniform)
    assert {len(ids) for b in uniform for ids, _, _ in samples_of(b)} == {512}


def test_baselines_follow_the_policy_gradient():
    """On-policy, the dapo loss's gradient is -A grad(logp) over the completion tokens / their count,
    the plain step's: every baseline that can run (float32, no autocast) gives the same direction."""
    from bench.gpu import SMOKE, build_model
    from bench.gpu_baselines_trl import build_baseline, resolve

    groups = make_groups("grpo", SMOKE["vocab_size"], True, np.random.default_rng(0))
    grads, ran = {}, []
    for name in ("hf", "trl", "trl_logits", "trl_liger"):
        kind, source = resolve(name)
        if kind is None:
            assert "not installed" in source and not HAVE["liger" if name == "trl_liger" else "trl"]
            continue
        model = build_model(SMOKE).train()
        loss = build_baseline(name, model, torch.device("cpu"), np.random.default_rng(1), autocast=False)(groups)
        assert math.isfinite(loss)
        g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        grads[name], ran = g / g.norm(), [*ran, (name, kind)]
    expected = {("hf", "own"), ("trl_logits", "trl" if HAVE["trl"] else "own")}
    expected |= {("trl", "trl")} if HAVE["trl"] else set()
    expected |= {("trl_liger", "liger")} if HAVE["liger"] else set()
    assert set(ran) == expected
    for name, g in grads.items():
        assert torch.allclose(g, grads["hf"], atol=1e-5), name


def test_cpu_smoke(tmp_path: Path):
    out = tmp_path / "rows.json"
    # hf_step runs in test_baselines_follow_the_policy_gradient; bf16 on this CPU is ~6x float32's time
    variants = ["default", "trl", "trl_logits", "trl_liger", "default+bf16"]
    proc = run_bench(
        "--cpu-smoke", "--steps", "1", "--modes", "fixed,sequence", "--sequence-steps", "2",
        "--variants", ",".join(variants), "--reference", "trl_logits", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    skipped = {s["variant"]: s["reason"] for s in result["skipped"]}
    missing = {"trl": not HAVE["trl"], "trl_liger": not HAVE["liger"]}
    assert set(skipped) == {v for v, gone in missing.items() if gone}
    assert all("not installed" in r for r in skipped.values())
    ran = [v for v in variants if v not in skipped]
    rows = result["rows"]
    assert {(r["mode"], r["batch"], r["variant"]) for r in rows} == {
        (m, b, v) for m in ("fixed", "sequence") for b in ("uniform", "grpo") for v in ran
    }
    for r in rows:
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["vs_ref"] > 0
        assert r["graphs_warmup"] == r["graphs_timed"] == 0  # eager variants compile nothing
        assert r["params_dtype"] == ("bfloat16" if r["variant"].endswith("+bf16") else "float32")
        assert r["steps"] == (1 if r["mode"] == "fixed" else 2)
    seq = {r["batch"]: r["tokens"] for r in rows if r["mode"] == "sequence" and r["variant"] == "default"}
    fixed = {r["batch"]: r["tokens"] for r in rows if r["mode"] == "fixed" and r["variant"] == "default"}
    assert seq != fixed  # the sequence's steps are other batches
    by_variant = {r["variant"]: r["source"] for r in rows}
    assert by_variant["trl_logits"].startswith("trl 1.16.0" if HAVE["trl"] else "own selective_log_softmax")
    for name in ("trl", "trl_logits", "trl_liger"):  # what ran with whose functions, said on stdout
        assert f"baseline {name}: " in proc.stdout
        assert (f"baseline {name}: SKIPPED" in proc.stdout) == (name in skipped)
    if HAVE["trl"]:
        assert "baseline trl: ran with TRL's own functions: trl 1.16.0" in proc.stdout
    assert "| sequence | grpo | default |" in proc.stdout and "| fixed | uniform | default+bf16 |" in proc.stdout
