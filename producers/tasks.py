"""Task datasets: deterministic prompt sets with disjoint train and eval splits.

A task example is a plain, JSON-able dict::

    {"id": str, "prompt": str (the user message text), "info": {"target": str, ...}}

``info`` travels with the prompt through the bus to the reward workers, which score a completion
against it (see ``rewards.registry``). ``render_messages`` turns an example into chat messages for
the policy's chat template.

Tasks:

- ``reverse_text`` (the default job): the prompt is a string of 5-12 random lowercase letters;
  the answer is that string reversed, e.g. ``"hello"`` -> ``"olleh"``. Train and eval are
  disjoint *by construction*, whatever their seeds: a string belongs to the eval split iff the
  first byte of ``sha256(string)`` is below ``EVAL_BUCKET_BYTES`` (1/16 of all strings), and a
  split keeps only its own strings (and no duplicates). The eval split has
  ``DEFAULT_EVAL_NUM_EXAMPLES`` (128) prompts drawn with ``DEFAULT_EVAL_SEED``.
"""

from __future__ import annotations

import hashlib
import random
import string
from typing import Any

KNOWN_TASKS = ("reverse_text",)
KNOWN_SPLITS = ("train", "eval")
DEFAULT_TASK = "reverse_text"
DEFAULT_EVAL_NUM_EXAMPLES = 128
DEFAULT_EVAL_SEED = 1234

# reverse_text distribution: lengths uniform in [MIN_LEN, MAX_LEN], letters uniform in a-z.
REVERSE_TEXT_MIN_LEN = 5
REVERSE_TEXT_MAX_LEN = 12
REVERSE_TEXT_ALPHABET = string.ascii_lowercase
# First sha256 byte < 16 -> eval split (1/16 of the string space).
EVAL_BUCKET_BYTES = 16


def split_of(text: str) -> str:
    """The split (``"train"`` or ``"eval"``) that owns ``text``, fixed by its sha256."""
    return "eval" if hashlib.sha256(text.encode()).digest()[0] < EVAL_BUCKET_BYTES else "train"


def _reverse_text_examples(split: str, num_examples: int, seed: int) -> list[dict[str, Any]]:
    # A distinct stream per split, so "train" and "eval" with the same seed do not share a prefix.
    rng = random.Random(f"reverse_text/{split}/{seed}")
    seen: set[str] = set()
    examples: list[dict[str, Any]] = []
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


def load_task_examples(
    task: str, split: str, num_examples: int, seed: int
) -> list[dict[str, Any]]:
    """Return ``num_examples`` examples of ``task``'s ``split``, deterministic in ``seed``.

    Args:
        task: one of ``KNOWN_TASKS``.
        split: ``"train"`` or ``"eval"``; the splits never share a prompt, whatever the seeds.
        num_examples: how many (>= 0); prompts within one call are distinct. The first ``n``
            examples for a seed do not depend on ``num_examples``.
        seed: any int; the standard eval set is ``split="eval", num_examples=128,
            seed=DEFAULT_EVAL_SEED``.

    Returns:
        A list of ``{"id": str, "prompt": str, "info": {"target": str}}``.

    Raises:
        ValueError: naming ``task``, ``split`` or ``num_examples`` when it is invalid.
    """
    if task not in KNOWN_TASKS:
        raise ValueError(f"unknown task={task!r}; known tasks: {', '.join(KNOWN_TASKS)}")
    if split not in KNOWN_SPLITS:
        raise ValueError(f"unknown split={split!r}; known splits: {', '.join(KNOWN_SPLITS)}")
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")
    return _reverse_text_examples(split, num_examples, seed)


def render_messages(
    example: dict[str, Any], system_prompt: str | None = None
) -> list[dict[str, str]]:
    """Chat messages for one example: an optional system turn, then the user turn.

    The default job uses no system prompt: the tiny policy learns the task from the data, and
    every prompt token costs compute on 2 CPU cores.
    """
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": example["prompt"]})
    return messages
