"""Reward functions by name.

A reward function maps ``(completion text, example info) -> float``; it is pure and cheap, so a
reward worker can call it on every sample of a group. The name is the task name of
``producers.tasks``.
"""

from __future__ import annotations

from typing import Any, Callable

from rewards.reverse_text import reverse_text_reward

RewardFn = Callable[[str, dict[str, Any]], float]

_REWARD_FNS: dict[str, RewardFn] = {
    "reverse_text": reverse_text_reward,
}


def known_reward_names() -> list[str]:
    """Sorted names accepted by ``get_reward_fn``."""
    return sorted(_REWARD_FNS)


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as ``name``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    try:
        return _REWARD_FNS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward name={name!r}; known: {', '.join(known_reward_names())}"
        ) from None
