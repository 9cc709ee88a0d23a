"""The :class:`Task` type and what every task shares: splits, prompt rendering, completion cleanup.

A task example is a JSON-able dict ``{"id": str, "prompt": str (the user message), "info": dict}``;
``info`` travels with the prompt to the reward workers, which call each reward function
``fn(completion, info) -> float`` and sum them with their weights. Splits are ``"train"`` and
``"eval"`` and never share a prompt; synthetic tasks make them disjoint by :func:`hash_split`.
No heavy imports: reward children import this module.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

KNOWN_SPLITS = ("train", "eval")
# First sha256 byte < 16 -> eval split (1/16 of the key space).
EVAL_BUCKET_BYTES = 16
# End-of-turn tokens a producer may leave at the end of a completion's text.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>")

Example = dict[str, Any]
Loader = Callable[[str, int, int], list[Example]]


@dataclasses.dataclass(frozen=True)
class Task:
    """A task. ``name``: what prompts and groups carry; ``load``: ``(split, num_examples, seed) ->
    [example]``, deterministic; ``rewards``: ``((reward ref, weight), ...)``; ``env``: a multi-turn
    task's environment path (:mod:`tasks.env`), its reward the term ``env``; ``tools``: schemas for
    the chat template (``env`` tasks only); ``agent``: the task's own agent path (:mod:`tasks.agent`).
    ValueError for ``tools`` without ``env``, or ``env`` with ``agent``.
    """

    name: str
    load: Loader
    system_prompt: str | None = None
    rewards: tuple[tuple[str, float], ...] = ()
    env: str | None = None
    max_turns: int = 1
    tools: tuple[dict[str, Any], ...] = ()
    agent: str | None = None

    def __post_init__(self) -> None:
        if self.tools and self.env is None:
            raise ValueError(f"task {self.name!r}: tools need an environment (Task.env) to run the calls")
        if self.env is not None and self.agent is not None:
            raise ValueError(
                f"task {self.name!r}: an environment (Task.env) and an agent (Task.agent) exclude each other"
            )


def check_request(split: str, num_examples: int) -> None:
    """ValueError unless ``split`` is in ``KNOWN_SPLITS`` and ``num_examples >= 0``."""
    if split not in KNOWN_SPLITS:
        raise ValueError(f"unknown split={split!r}; known splits: {', '.join(KNOWN_SPLITS)}")
    if num_examples < 0:
        raise ValueError(f"num_examples must be >= 0, got {num_examples}")


def hash_split(key: str) -> str:
    """``"eval"`` iff the first byte of ``sha256(key)`` is below ``EVAL_BUCKET_BYTES`` (1/16), else ``"train"``."""
    return "eval" if hashlib.sha256(key.encode()).digest()[0] < EVAL_BUCKET_BYTES else "train"


def render_messages(example: Example, system_prompt: str | None = None) -> list[dict[str, str]]:
    """Chat messages of one example: the optional system turn, then the user turn."""
    messages = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    messages.append({"role": "user", "content": example["prompt"]})
    return messages


def strip_end_of_turn(completion: str) -> str:
    """``completion`` without surrounding whitespace and trailing ``END_OF_TURN_TOKENS``."""
    text = completion.strip()
    stripped = True
    while stripped:
        stripped = False
        for token in END_OF_TURN_TOKENS:
            if text.endswith(token):
                text = text[: -len(token)].rstrip()
                stripped = True
    return text.lstrip()
