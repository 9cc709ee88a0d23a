"""The ``reverse_turns`` task: a multi-turn episode of reverse_text turns with an environment.

Dataset: each example holds ``REVERSE_TURNS_WORDS`` (2) distinct strings of 5-8
(``REVERSE_TURNS_MIN_LEN``..``REVERSE_TURNS_MAX_LEN``) random lowercase letters. The user turn is
the first string; the model answers; the environment (:class:`ReverseTurnsEnv`) scores the answer
and replies with the next string as a user turn; after the last string's answer the episode is
done. ``info = {"words": [str, ...]}``. No system prompt. Short strings keep episodes small on
the tiny byte-level policy (about 40 prompt + env tokens and two answers of <= 9 tokens).

Chosen so that the tiny default policy (warm-started on reverse_text, :mod:`policies.tiny_model`)
can learn it on CPU: every turn is the reverse_text skill, but the second turn is conditioned on
the whole conversation so far (the model's first answer and the env's turn), which is what a
multi-turn pipeline must get token-exact.

Reward (:meth:`ReverseTurnsEnv.reward`): the mean over all strings of the per-turn difflib ratio
(:func:`tasks.reverse_text.reverse_text_reward`) of the answer against the reversed string; a
string the episode never reached (max_turns, length) scores 0. In [0, 1]; 1 iff every answer is
exact.

Splits: disjoint by construction, an example belongs to the eval split iff ``hash_split`` of its
strings joined by ``","`` says so (:func:`tasks.task.hash_split`).
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
    """``num_examples`` examples of ``split``, deterministic in ``seed``.

    Returns:
        ``[{"id": "reverse_turns/<split>/<seed>/<k>", "prompt": first word, "info": {"words": [...]}}]``.

    Raises:
        ValueError: naming ``split`` or ``num_examples`` when invalid.
    """
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
        """State ``{"words": [...], "scores": []}``.

        Raises:
            TypeError: ``info["words"]`` is missing or not a non-empty list of str.
        """
        words = info.get("words") if isinstance(info, dict) else None
        if not (isinstance(words, list) and words and all(isinstance(w, str) for w in words)):
            raise TypeError(f"reverse_turns needs info['words'] as a non-empty list of str, got info={info!r:.200}")
        return {"words": words, "scores": []}

    @staticmethod
    def step(state: dict[str, Any], text: str) -> tuple[list[dict[str, str]], bool, dict[str, Any]]:
        """Score ``text`` against the current string reversed; reply with the next string (a user
        turn), or done after the last one."""
        scores = [*state["scores"], reverse_text_reward(text, {"target": state["words"][len(state["scores"])][::-1]})]
        new_state = {"words": state["words"], "scores": scores}
        if len(scores) >= len(state["words"]):
            return [], True, new_state
        return [{"role": "user", "content": state["words"][len(scores)]}], False, new_state

    @staticmethod
    def reward(state: dict[str, Any]) -> float:
        """Mean per-string score over all strings (unreached ones 0), in [0, 1]."""
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
