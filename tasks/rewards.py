"""Reward functions by name or by import path.

A reward function maps ``(completion, info) -> float`` (``info``: docs/rewards.md). A reference is a
registered name (the built-in tasks') or an import path ``"package.module:function"``; with a
``trl:``/``trl_conversational:`` prefix, a TRL-style function (:mod:`tasks.trl_rewards`). Registered
functions are imported on first use: ``gsm8k``'s math-verify costs ~0.25 s per reward child.
"""

from __future__ import annotations

from typing import Any, Callable

from tasks.import_path import import_callable
from tasks.trl_rewards import split_trl_ref, trl_caller

RewardFn = Callable[[str, dict[str, Any]], float]

_REWARD_FNS: dict[str, str] = {
    "reverse_text": "tasks.reverse_text:reverse_text_reward",
    "gsm8k": "tasks.gsm8k:gsm8k_reward",
    "countdown": "tasks.countdown:countdown_reward",
}


def known_reward_names() -> list[str]:
    """Sorted names accepted by ``get_reward_fn``."""
    return sorted(_REWARD_FNS)


def _unknown_name(name: str) -> ValueError:
    """The error for a reference that is neither a registered name nor an import path."""
    return ValueError(
        f"unknown reward name={name!r}; known: {', '.join(known_reward_names())}, "
        "or an import path 'package.module:function'"
    )


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as ``name`` or at its import path (imported in this process).
    ValueError for an unknown name or an unresolvable path."""
    fmt, path = split_trl_ref(name)
    if fmt is not None:
        return import_callable(path, f"TRL-style ({fmt} format) reward")
    if ":" in name:
        return import_callable(name, "reward")
    if name not in _REWARD_FNS:
        raise _unknown_name(name)
    return import_callable(_REWARD_FNS[name], f"reward {name!r}")


def reward_name(ref: str) -> str:
    """The ``reward_terms`` name of a reference, without importing: a registered name, or the function's
    name (``"my_pkg.scoring:Judge.score"`` -> ``"score"``). ValueError for a malformed reference."""
    fmt, ref = split_trl_ref(ref)
    if ":" not in ref and fmt is None:
        if ref not in _REWARD_FNS:
            raise _unknown_name(ref)
        return ref
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward import path={ref!r} must look like 'package.module:function'")
    return attr.rsplit(".", 1)[-1]


def get_float_reward_fn(name: str) -> Callable[..., Any]:
    """The reward children's resolver: :func:`get_reward_fn` with ``float`` applied to its result, or
    for a TRL-style reference :func:`tasks.trl_rewards.trl_caller`. ValueError as :func:`get_reward_fn`."""
    fn = get_reward_fn(name)
    fmt, path = split_trl_ref(name)
    if fmt is not None:
        return trl_caller(fn, fmt, path)

    def call(completion: str, info: dict[str, Any]) -> float:
        return float(fn(completion, info))

    return call
