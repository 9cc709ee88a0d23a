"""Reward functions by name or by import path.

A reward function maps ``(completion text, example info) -> float``; a reward worker calls it on
every sample of a group (in child processes when ``rewards.isolate``, see :mod:`rewards.scorers`).
Each built-in task's module holds its reward function (:mod:`tasks.reverse_text`,
:mod:`tasks.gsm8k`, :mod:`tasks.countdown`).
A reference is either a registered name (``reverse_text``, ``gsm8k``, ``countdown``) or an import
path ``"package.module:function"`` for a custom function. An import path executes the code it
names, so references come only from the run config (trusted), never from the bus. An import path
prefixed ``trl:`` or ``trl_conversational:`` names a reward function written for TRL's
``GRPOTrainer`` (``fn(completions, **kwargs) -> list[float]``), called once per group with TRL's
keyword arguments (:mod:`tasks.trl_rewards`).

Registered functions are themselves stored as import paths and imported on first use: the
``gsm8k`` verifier pulls in math-verify and sympy (``python -X importtime``: ~0.25 s of a ~0.3 s
child start), which a worker scoring only ``reverse_text`` should not pay in every child.
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
    """The reward function registered as ``name``, or the one at import path ``"package.module:function"``
    (imported here, so in the calling process; ``function`` may be dotted, ``Class.method``).

    Raises:
        ValueError: for an unknown name (listing the known ones), or an import path whose module or
            attribute cannot be found or is not callable.
    """
    fmt, path = split_trl_ref(name)
    if fmt is not None:
        return import_callable(path, f"TRL-style ({fmt} format) reward")
    if ":" in name:
        return import_callable(name, "reward")
    if name not in _REWARD_FNS:
        raise _unknown_name(name)
    return import_callable(_REWARD_FNS[name], f"reward {name!r}")


def reward_name(ref: str) -> str:
    """The display name of a reward reference, used for ``reward_terms`` and ``reward/<name>`` logs:
    a registered name is itself, an import path gives its function's name
    (``"my_pkg.scoring:Judge.score"`` -> ``"score"``, ``"trl:my_pkg:reward_len"`` -> ``"reward_len"``).
    Does not import anything.

    Raises:
        ValueError: ``ref`` is neither a registered name nor shaped like ``"package.module:function"``
            (after an optional ``trl:``/``trl_conversational:`` prefix).
    """
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
    """:func:`get_reward_fn` with its result passed through ``float`` (the resolver of the reward
    children, :class:`rewards.scorers.IsolatedScorer`: a non-number fails in the child as a
    ``TypeError``/``ValueError`` of that call). A TRL-style reference gives the group-wise
    ``call(completions, info, batch) -> {"rewards", "metrics"}`` of :func:`tasks.trl_rewards.trl_caller`.

    Raises:
        ValueError: as :func:`get_reward_fn`.
    """
    fn = get_reward_fn(name)
    fmt, path = split_trl_ref(name)
    if fmt is not None:
        return trl_caller(fn, fmt, path)

    def call(completion: str, info: dict[str, Any]) -> float:
        return float(fn(completion, info))

    return call
