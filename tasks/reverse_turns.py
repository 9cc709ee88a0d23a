"""The ``reverse_turns`` task: a multi-turn episode of reverse_text turns with an environment.

Each example holds ``REVERSE_TURNS_WORDS`` strings of 5-8 lowercase letters (``info = {"words":
[str]}``): the first is the prompt, :class:`ReverseTurnsEnv` scores each answer and replies with the
next string. Every turn is the tiny policy's reverse_text skill, conditioned on the whole
conversation so far, which a multi-turn pipeline must get token-exact. Splits by
:func:`tasks.task.hash_split` of the strings joined by ``","``.
"""

from __future__ import annotations

import random
from typing import Any

from tasks.reverse_text import REVERSE_TEXT_ALPHABET, reverse_text_reward
from tasks.task import Example, Task, check_request, hash_split

REVERSE_TURNS_WORDS = 2
REVERSE_TURNS_MIN_LEN = 5
REVERSE_TURNS_MAX_LEN = 8


def reverse_turns_examples(split: str, num_examples: int, seed: int) -> list[Example]:
    """``num_examples`` examples ``{"id": "reverse_turns/<split>/<seed>/<k>", "prompt", "info"}``;
    ValueError for an invalid ``split`` or ``num_examples``."""
    check_request(split, num_examples)
    rng = random.Random(f"reverse_turns/{split}/{seed}")
    seen: set[str] = set()
    examples: list[Example] = []
    while len(examples) < num_examples:
        words = [
            "".join(
                rng.choice(REVERSE_TEXT_ALPHABET)
                for _ in range(rng.randint(REVERSE_TURNS_MIN_LEN, REVERSE_TURNS_MAX_LEN))
            )
            for _ in range(REVERSE_TURNS_WORDS)
        ]
        key = ",".join(words)
        if key in seen or hash_split(key) != split:
            continue
        seen.add(key)
        examples.append(
            {"id": f"reverse_turns/{split}/{seed}/{len(examples)}", "prompt": words[0], "info": {"words": words}}
        )
    return examples


class ReverseTurnsEnv:
    """The environment of ``reverse_turns`` (:mod:`tasks.env` protocol; state-passing, JSON only)."""

    @staticmethod
    def reset(info: dict[str, Any]) -> dict[str, Any]:
        """State ``{"words", "scores": []}``; TypeError unless ``info["words"]`` is a non-empty list of str."""
        words = info.get("words") if isinstance(info, dict) else None
        if not (isinstance(words, list) and words and all(isinstance(w, str) for w in words)):
            raise TypeError(f"reverse_turns needs info['words'] as a non-empty list of str, got info={info!r:.200}")
        return {"words": words, "scores": []}

    @staticmethod
    def step(state: dict[str, Any], text: str) -> tuple[list[dict[str, str]], bool, dict[str, Any]]:
        """Score ``text``; reply with the next string, or done after the last."""
        scores = [*state["scores"], reverse_text_reward(text, {"target": state["words"][len(state["scores"])][::-1]})]
        new_state = {"words": state["words"], "scores": scores}
        if len(scores) >= len(state["words"]):
            return [], True, new_state
        return [{"role": "user", "content": state["words"][len(scores)]}], False, new_state

    @staticmethod
    def reward(state: dict[str, Any]) -> float:
        """Mean difflib ratio over all strings (unreached ones 0), in [0, 1]."""
        return sum(state["scores"]) / len(state["words"])


def make_task() -> Task:
    """The registered ``reverse_turns`` task (environment :class:`ReverseTurnsEnv`, max 2 turns)."""
    return Task(
        "reverse_turns",
        reverse_turns_examples,
        None,
        (),
        env="tasks.reverse_turns:ReverseTurnsEnv",
        max_turns=REVERSE_TURNS_WORDS,
    )
