"""Eval prompt ids on the wire: ``e{round:06d}-{task}-{i:05d}``, made by the prompt source and
parsed by the packer (the one place that format is written down).

An eval prompt's id names its round, its task and its example; training prompts are
``p{index:08d}`` (:func:`prompts.source.prompt_id`), which never parse as eval ids. Task names may
hold ``-`` (an import path as well): the task part is matched greedily. Rounds and indices wider
than their padding (round >= 10**6) still parse.
"""

from __future__ import annotations

import re

EVAL_ID = re.compile(r"^e(\d{6,})-(.+)-(\d{5,})$")
"""Eval prompt ids ``e{round:06d}-{task}-{i:05d}`` (task names may hold ``-``: matched greedily)."""


def eval_prompt_id(round_: int, task: str, i: int) -> str:
    """The id of example ``i`` of ``task`` in eval round ``round_`` (``"e000010-gsm8k-00003"``)."""
    return f"e{round_:06d}-{task}-{i:05d}"


def parse_eval_id(group_id: str) -> tuple[int, str] | None:
    """``(round, task)`` of an eval prompt id ``e{round:06d}-{task}-{i:05d}``; None for any other id."""
    match = EVAL_ID.match(group_id)
    return (int(match.group(1)), match.group(2)) if match else None


def is_eval_id(prompt_id: str) -> bool:
    """True for an eval prompt's id (:func:`eval_prompt_id`); training ids are ``p%08d``."""
    return EVAL_ID.match(prompt_id) is not None
