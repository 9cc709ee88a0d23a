"""The ``reverse_text`` task (the default job): reverse a string of 5-12 random lowercase letters.

``info = {"target": the reversed string}``; no system prompt. Splits by
:func:`tasks.task.hash_split` of the string, each from its own seeded stream.
"""

from __future__ import annotations

import difflib
import random
import string
from typing import Any

from tasks.task import Example, Task, check_request, hash_split, strip_end_of_turn

# Length uniform in [MIN_LEN, MAX_LEN], letters uniform in a-z.
REVERSE_TEXT_MIN_LEN = 5
REVERSE_TEXT_MAX_LEN = 12
REVERSE_TEXT_ALPHABET = string.ascii_lowercase


def split_of(text: str) -> str:
    """The split (``"train"`` or ``"eval"``) that owns ``text``, fixed by its sha256."""
    return hash_split(text)


def reverse_text_examples(split: str, num_examples: int, seed: int) -> list[Example]:
    """``num_examples`` distinct examples ``{"id": "reverse_text/<split>/<seed>/<k>", "prompt", "info"}``,
    deterministic in ``seed``. ValueError for an invalid ``split`` or ``num_examples``."""
    check_request(split, num_examples)
    # A distinct stream per split, so "train" and "eval" with the same seed do not share a prefix.
    rng = random.Random(f"reverse_text/{split}/{seed}")
    seen: set[str] = set()
    examples: list[Example] = []
    while len(examples) < num_examples:
        length = rng.randint(REVERSE_TEXT_MIN_LEN, REVERSE_TEXT_MAX_LEN)
        text = "".join(rng.choice(REVERSE_TEXT_ALPHABET) for _ in range(length))
        if text in seen or split_of(text) != split:
            continue
        seen.add(text)
        examples.append(
            {
                "id": f"reverse_text/{split}/{seed}/{len(examples)}",
                "prompt": text,
                "info": {"target": text[::-1]},
            }
        )
    return examples


def reverse_text_reward(completion: str, info: dict[str, Any]) -> float:
    """``difflib.SequenceMatcher(None, completion, target).ratio()`` = 2 M / (|completion| + |target|)
    (M: matched characters), in [0, 1], after :func:`~tasks.task.strip_end_of_turn`.
    TypeError when ``info["target"]`` is not a str."""
    target = info.get("target") if isinstance(info, dict) else None
    if not isinstance(target, str):
        raise TypeError(f"reverse_text needs info['target'] as str, got info={info!r}")
    return difflib.SequenceMatcher(None, strip_end_of_turn(completion), target).ratio()


def make_task() -> Task:
    """The registered ``reverse_text`` task (no system prompt, reward ``reverse_text`` weight 1)."""
    return Task("reverse_text", reverse_text_examples, None, (("reverse_text", 1.0),))
