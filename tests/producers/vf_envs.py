"""verifiers environments for tests/producers/test_verifiers_envs.py, loaded by rlbus as the task
``verifiers:tests.producers.vf_envs`` (``load_environment(kind=...)``, the way verifiers packages
its environments) in the prompt source and the isolated agent children (kept apart from the test
module so the children do not import pytest or torch).

The policy of those tests answers every turn with one of two tokens, then end-of-turn: ``ANSWER``
("5") or ``TOOL_CALL`` (one added token whose text is a Qwen/Hermes ``<tool_call>`` block calling
``add(a=2, b=3)``), so the environments see real tool calls and real answers:

- ``kind="single"``: a ``vf.SingleTurnEnv``; rubric ``correct`` (1 if the answer is the row's).
- ``kind="tool"``: a ``vf.ToolEnv`` with the tool ``add`` and at most ``MAX_TURNS`` model turns;
  rubric ``correct`` (weight 1) + ``used_tool`` (weight 0.5: a tool message answered "5").
"""

from __future__ import annotations

import json

import verifiers as vf
from datasets import Dataset

ANSWER = "5"
TOOL_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
MAX_TURNS = 3
ROWS = [
    {"question": "What is 2 + 3?", "answer": "5"},
    {"question": "What is 1 + 4?", "answer": "5"},
    {"question": "What is 3 + 4?", "answer": "7"},
    {"question": "What is 0 + 5?", "answer": "5"},
]
USED_TOOL_WEIGHT = 0.5


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return a + b


def correct(completion, answer, parser) -> float:
    """1 if the final answer is the row's answer, else 0."""
    return float((parser.parse_answer(completion) or "").strip() == answer)


def used_tool(completion) -> float:
    """1 if a tool message answered "5" (the tool ran on the model's call), else 0."""
    return float(any(m.role == "tool" and m.content == ANSWER for m in completion))


def load_environment(kind: str = "single") -> vf.Environment:
    """The test environment ``kind`` ("single" or "tool"; module docstring).

    Raises:
        ValueError: unknown ``kind``.
    """
    dataset = Dataset.from_list([dict(r) for r in ROWS])
    parser = vf.Parser()
    if kind == "single":
        return vf.SingleTurnEnv(
            dataset=dataset, parser=parser, rubric=vf.Rubric(funcs=[correct], weights=[1.0], parser=parser)
        )
    if kind == "tool":
        rubric = vf.Rubric(funcs=[correct, used_tool], weights=[1.0, USED_TOOL_WEIGHT], parser=parser)
        return vf.ToolEnv(dataset=dataset, tools=[add], max_turns=MAX_TURNS, parser=parser, rubric=rubric)
    raise ValueError(f"kind must be 'single' or 'tool', got {json.dumps(kind)}")
