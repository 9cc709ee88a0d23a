"""What ``busctl eval`` changes in a job, without starting it: the config (eval.only, run directory,
model.path checks), the component table (no trainer), the device plan (every GPU for the
producers), the eval rounds (round 0 alone) and the prompt source (eval prompts only, at once).
The whole command runs end to end in test_eval.py."""

from __future__ import annotations

import json

import pytest

from busctl.components.table import component_table
from busctl.evaluate import eval_config
from busctl.components.placement import plan_placement
from configs.schema import ConfigError, load_config
from prompts.eval_rounds import EvalRounds, EvalSet, eval_round_versions
from prompts.source import PromptSource
from tasks.registry import load_task_examples


def test_eval_config_runs_beside_the_training_run_dir():
    cfg = eval_config("configs/reverse_text.yaml", ["eval.enabled=false", "trainer.device=cuda"])
    assert cfg.eval.only and cfg.eval.enabled and cfg.broadcast.method == "filesystem"
    assert cfg.run_dir == load_config("configs/reverse_text.yaml").run_dir + "-eval"
    assert eval_config("configs/reverse_text.yaml", ["run_dir=/tmp/x"]).run_dir == "/tmp/x"
    assert eval_config("configs/reverse_text.yaml", [], run_dir="/tmp/y").run_dir == "/tmp/y"
    assert "trainer" not in [s.role for s in component_table(cfg)]
    assert "trainer" in [s.role for s in component_table(load_config("configs/reverse_text.yaml"))]
    assert eval_round_versions(cfg.eval, cfg.trainer.max_steps) == [0]


def test_eval_plan_gives_the_producers_every_gpu():
    overrides = [
        "trainer.data_parallel=2",
        "trainer.gpus=[0, 1]",
        "producers.replicas=2",
        "producers.gpus_per_replica=1",
    ]
    with pytest.raises(ConfigError, match="does not fit"):  # training: both GPUs are the trainer's
        plan_placement(load_config("configs/reverse_text.yaml", overrides), [0, 1])
    plan = plan_placement(eval_config("configs/reverse_text.yaml", overrides), [0, 1])
    assert plan.trainer_device == "cpu" and plan.trainer_gpus == ()
    assert plan.producer_gpus[:2] == ((0,), (1,))


def test_a_lora_adapter_is_refused_with_the_merge_command(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/base", "peft_type": "LORA"}))
    with pytest.raises(ConfigError, match="--merge-lora"):
        eval_config("configs/reverse_text.yaml", [f"model.path={tmp_path}"])


def test_prompt_source_without_training_issues_round_zero_alone():
    examples = load_task_examples("reverse_text", "train", 3, 0)
    sets = [EvalSet("reverse_text", None, load_task_examples("reverse_text", "eval", 4, 1))]
    source = PromptSource(
        examples,
        task="reverse_text",
        prompts_per_step=2,
        max_async_level=1,
        max_steps=10,
        eval_rounds=EvalRounds([0], sets, temperature=1.0),
        train=False,
    )
    issued = []
    while source.may_issue():
        issued.append(source.issue())
    assert [p.eval_round for p in issued] == [0] * 4 and source.ledger.num_issued == 0
    source.on_weights_applied("producer-0", 5)
    assert not source.may_issue()
    training = PromptSource(
        examples,
        task="reverse_text",
        prompts_per_step=2,
        max_async_level=1,
        max_steps=10,
        eval_rounds=EvalRounds([0], sets, temperature=1.0),
    )
    first = training.issue()
    assert first.eval_round == -1  # a training job: round 0 waits for the first step's training prompts
