"""Reward of the ``reverse_text`` task: similarity of the completion to the reversed input.

    r = difflib.SequenceMatcher(None, completion, target).ratio()
      = 2 * M / (len(completion) + len(target))

where M is the number of characters in the matching blocks difflib finds (greedy longest common
substring, recursively on both sides). r is in [0, 1]; 1.0 iff the completion equals the target.
Before comparing, the completion loses a trailing end-of-turn token (``<|im_end|>`` or
``<|endoftext|>``, when a producer keeps special tokens in the text) and surrounding whitespace.
"""

from __future__ import annotations

import difflib
from typing import Any

END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")


def strip_end_of_turn(completion: str) -> str:
    """Remove surrounding whitespace and any trailing end-of-turn tokens from ``completion``."""
    text = completion.strip()
    stripped = True
    while stripped:
        stripped = False
        for token in END_OF_TURN_TOKENS:
            if text.endswith(token):
                text = text[: -len(token)].rstrip()
                stripped = True
    return text.lstrip()


def reverse_text_reward(completion: str, info: dict[str, Any]) -> float:
    """difflib ratio of the cleaned ``completion`` against ``info["target"]`` (a float in [0, 1]).

    Raises:
        TypeError: when ``info["target"]`` is missing or not a str.
    """
    target = info.get("target") if isinstance(info, dict) else None
    if not isinstance(target, str):
        raise TypeError(f"reverse_text needs info['target'] as str, got info={info!r}")
    return difflib.SequenceMatcher(None, strip_end_of_turn(completion), target).ratio()
