"""Tests for prompts.eval_rounds: the evaluated versions and the round prompts."""

from __future__ import annotations

import pytest

from bus.codec import decode, encode
from configs.schema import load_config
from prompts.eval_rounds import EvalRounds, EvalSet, build_eval_rounds, eval_round_versions
from tasks.registry import load_task_examples


def _eval(*overrides: str):
    return load_config(None, list(overrides)).eval


@pytest.mark.parametrize(
    "overrides, max_steps, expected",
    [
        ([], 10, [0, 10]),
        (["eval.interval=3"], 10, [0, 3, 6, 9, 10]),
        (["eval.interval=5"], 10, [0, 5, 10]),  # 10 is max_steps: once
        (["eval.interval=4", "eval.eval_base_model=false"], 8, [4, 8]),
        (["eval.interval=20"], 10, [0, 10]),
        (["eval.enabled=false", "eval.interval=2"], 10, []),
    ],
)
def test_eval_round_versions(overrides, max_steps, expected):
    assert eval_round_versions(_eval(*overrides), max_steps) == expected


def test_eval_round_versions_rejects_bad_max_steps():
    with pytest.raises(ValueError, match="max_steps"):
        eval_round_versions(_eval(), 0)


def _sets():
    return [
        EvalSet("reverse_text", None, load_task_examples("reverse_text", "eval", 3, 1234)),
        EvalSet("other", "Be brief.", load_task_examples("reverse_text", "eval", 2, 99)),
    ]


def test_round_prompts():
    rounds = EvalRounds([0, 2], _sets(), temperature=0.6)
    assert rounds.round_size == 5
    assert rounds.due(0) == [0] and rounds.due(5) == [0, 2]
    prompts = rounds.issue(2)
    assert [p.id for p in prompts] == [f"e000002-reverse_text-0000{i}" for i in range(3)] + [
        "e000002-other-00000",
        "e000002-other-00001",
    ]
    assert [p.index for p in prompts] == list(range(5))
    assert {(p.step, p.eval_round, p.eval_size, p.temperature, p.is_eval) for p in prompts} == {(2, 2, 5, 0.6, True)}
    assert prompts[0].messages == [{"role": "user", "content": rounds.sets[0].examples[0]["prompt"]}]
    assert prompts[3].messages[0] == {"role": "system", "content": "Be brief."}
    assert prompts[3].task == "other" and prompts[3].info == rounds.sets[1].examples[0]["info"]
    assert decode(encode(prompts[4])).eval_size == 5
    assert rounds.due(5) == [0]  # once only
    with pytest.raises(ValueError, match="not pending"):
        rounds.issue(2)
    with pytest.raises(ValueError, match="not pending"):
        rounds.issue(1)


def test_rounds_need_examples_and_a_temperature():
    with pytest.raises(ValueError, match="held-out"):
        EvalRounds([0], [EvalSet("t", None, [])], temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        EvalRounds([0], _sets(), temperature=0.0)
    assert EvalRounds([], [], temperature=1.0).due(10) == []


def test_build_eval_rounds_from_config():
    cfg = load_config(
        None,
        [
            "trainer.max_steps=4",
            "eval.interval=2",
            "eval.temperature=0.5",
            "eval.tasks=[{name: reverse_text, num_examples: 3, seed: 7}]",
        ],
    )
    rounds = build_eval_rounds(cfg)
    assert rounds.rounds == [0, 2, 4] and rounds.temperature == 0.5
    assert [ex["prompt"] for ex in rounds.sets[0].examples] == [
        ex["prompt"] for ex in load_task_examples("reverse_text", "eval", 3, 7)
    ]
    assert build_eval_rounds(load_config(None, ["eval.enabled=false"])).rounds == []
