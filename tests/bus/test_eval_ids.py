"""Tests for bus.eval_ids: the eval prompt id format, made by the prompt source and parsed by the packer."""

from __future__ import annotations

from bus.eval_ids import eval_prompt_id, is_eval_id, parse_eval_id
from prompts.source import prompt_id


def test_ids():
    assert eval_prompt_id(10, "gsm8k", 3) == "e000010-gsm8k-00003"
    assert is_eval_id("e000010-gsm8k-00003") and is_eval_id(eval_prompt_id(0, "pkg.mod:task", 12))
    assert not is_eval_id("p00000003") and not is_eval_id("e12-x-1")


def test_made_ids_parse_back_and_training_ids_never_do():
    for round_, task, i in [(0, "gsm8k", 0), (7, "my-task", 12), (1_234_567, "pkg.mod:fn", 123_456)]:
        made = eval_prompt_id(round_, task, i)
        assert is_eval_id(made) and parse_eval_id(made) == (round_, task)
    assert not any(is_eval_id(prompt_id(index)) for index in (0, 5, 10**8))
