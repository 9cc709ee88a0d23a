"""Eval prompt ids on the wire, ``e{round:06d}-{task}-{i:05d}``: made by the prompt source, parsed by the
packer. Training ids (``p{index:08d}``) never parse as eval ids; task names may hold ``-`` (matched greedily).
"""

from __future__ import annotations

import re

EVAL_ID = re.compile(r"^e(\d{6,})-(.+)-(\d{5,})$")


def eval_prompt_id(round_: int, task: str, i: int) -> str:
    """The id of example ``i`` of ``task`` in eval round ``round_`` (``"e000010-gsm8k-00003"``)."""
    return f"e{round_:06d}-{task}-{i:05d}"


def parse_eval_id(group_id: str) -> tuple[int, str] | None:
    """``(round, task)`` of an eval prompt id; None for any other id."""
    match = EVAL_ID.match(group_id)
    return (int(match.group(1)), match.group(2)) if match else None


def is_eval_id(prompt_id: str) -> bool:
    """True for an eval prompt's id (:func:`eval_prompt_id`)."""
    return EVAL_ID.match(prompt_id) is not None
