"""The ``reverse_text`` task (the default job): reverse a short random string.

Dataset: the prompt is a string of 5-12 (``REVERSE_TEXT_MIN_LEN``..``REVERSE_TEXT_MAX_LEN``,
uniform) random lowercase letters (uniform in a-z); the answer is that string reversed, e.g.
``"hello"`` -> ``"olleh"``; ``info = {"target": reversed string}``. No system prompt.

Splits: train and eval are disjoint *by construction*, whatever their seeds: a string belongs to
the eval split iff the first byte of ``sha256(string)`` is below ``tasks.task.EVAL_BUCKET_BYTES``
(:func:`tasks.task.hash_split`), and a split keeps only its own strings (and no duplicates). Each
split draws from its own seeded stream; ids are ``"reverse_text/{split}/{seed}/{k}"``.

Reward (:func:`reverse_text_reward`): similarity of the completion to the reversed input,

    r = difflib.SequenceMatcher(None, completion, target).ratio()
      = 2 * M / (len(completion) + len(target))

where M is the number of characters in the matching blocks difflib finds (greedy longest common
substring, recursively on both sides). r is in [0, 1]; 1.0 iff the completion equals the target.
Before comparing, the completion loses a trailing end-of-turn token (``<|im_end|>`` or
``<|endoftext|>``, :func:`tasks.task.strip_end_of_turn`) and surrounding whitespace.
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
    """``num_examples`` distinct strings of ``split`` as examples, deterministic in ``seed``.

    Returns:
        ``[{"id": "reverse_text/<split>/<seed>/<k>", "prompt": str, "info": {"target": str}}]``.

    Raises:
        ValueError: naming ``split`` or ``num_examples`` when invalid.
    """
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
    """difflib ratio of the cleaned ``completion`` against ``info["target"]`` (a float in [0, 1]).

    Raises:
        TypeError: when ``info["target"]`` is missing or not a str.
    """
    target = info.get("target") if isinstance(info, dict) else None
    if not isinstance(target, str):
        raise TypeError(f"reverse_text needs info['target'] as str, got info={info!r}")
    return difflib.SequenceMatcher(None, strip_end_of_turn(completion), target).ratio()


def make_task() -> Task:
    """The registered ``reverse_text`` task (no system prompt, reward ``reverse_text`` weight 1)."""
    return Task("reverse_text", reverse_text_examples, None, (("reverse_text", 1.0),))
