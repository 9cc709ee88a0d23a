"""The task ``verifiers:MODULE`` (tasks.verifiers_env) without a model: the registry builds it
from the run's task section, its examples are the real verifiers environment's dataset rows
(tests/producers/vf_envs.py), the splits never share a prompt, and the config errors name what is
wrong. The rollouts themselves run in tests/producers/test_verifiers_envs.py (real vLLM)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("verifiers")

from configs.schema import load_config
from tasks.registry import get_task, load_task_examples, reward_spec, task_agent
from tasks.verifiers_env import AGENT, load_env
from tests.producers import vf_envs

TASK = "verifiers:tests.producers.vf_envs"


def _cfg(*overrides: str):
    return load_config(overrides=[f"task.name={TASK}", "task.verifiers_args={kind: tool}", "eval.tasks=[]", *overrides])


def test_examples_are_the_environments_rows_and_the_splits_disjoint():
    cfg = _cfg()
    task = get_task(TASK, cfg.task)
    assert task.agent == AGENT and task.rewards == () and task_agent(cfg) == AGENT
    assert reward_spec(cfg) == {TASK: ()}  # the rubric is the only reward (term env)
    train = load_task_examples(task, "train", 100, seed=0)
    evals = load_task_examples(task, "eval", 100, seed=0)
    assert len(train) + len(evals) == len(vf_envs.ROWS)  # no eval_dataset: the rows are split by their prompt
    assert not {e["prompt"] for e in train} & {e["prompt"] for e in evals}
    questions = {r["question"]: r["answer"] for r in vf_envs.ROWS}
    for ex in train + evals:
        spec = ex["info"]["verifiers"]
        assert spec["module"] == "tests.producers.vf_envs" and spec["args"] == {"kind": "tool"}
        assert spec["row"]["prompt"] == [{"role": "user", "content": ex["prompt"]}]
        assert spec["row"]["answer"] == questions[ex["prompt"]]
        json.dumps(ex["info"])  # travels on the bus
    assert [e["id"] for e in load_task_examples(task, "train", 100, seed=0)] == [e["id"] for e in train]
    assert type(load_env("tests.producers.vf_envs", {"kind": "tool"})).__name__ == "ToolEnv"


def test_config_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match="verifiers:MODULE"):
        get_task("verifiers: ")
    with pytest.raises(ValueError, match="task.dataset does not apply"):
        get_task(TASK, _cfg("task.dataset.path=rows.jsonl").task)
    with pytest.raises(ValueError, match="runs its own agent"):
        task_agent(_cfg("task.agent=tests.producers.endpoint_agents:two_turn_agent"))
    with pytest.raises(ValueError, match="kind must be"):
        load_task_examples(get_task(TASK, _cfg("task.verifiers_args={kind: nope}").task), "train", 1, 0)
    with pytest.raises(ValueError, match="Could not import"):
        load_task_examples(get_task("verifiers:no_such_env_module"), "train", 1, 0)
