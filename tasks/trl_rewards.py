"""TRL-style reward functions, called as TRL's ``GRPOTrainer`` calls them, used as they are.

A reward reference with the prefix ``trl:`` (standard format) or ``trl_conversational:``
(conversational format) names a function written for TRL (``task.rewards[].name``, e.g.
``trl:my_rewards:reward_len``)::

    def reward_len(completions, **kwargs) -> list[float]: ...

It is called once per group, with the whole group as TRL's batch, with TRL's keyword arguments
(TRL ``docs/source/grpo_trainer.md``, "Using a custom reward function", and
``GRPOTrainer._calculate_rewards``, which calls ``reward_func(prompts=..., completions=...,
completion_ids=..., **reward_kwargs)``):

- ``prompts``: ``[G]`` the group's prompt, once per completion: in conversational format the
  prompt's chat messages, ``[{"role": ..., "content": ...}, ...]`` (``RolloutGroup.prompt_messages``,
  before the chat template; a separate copy per completion), so ``prompts[i][-1]["content"]`` is
  the user's message as in TRL; in standard format the rendered prompt text
  (``RolloutGroup.prompt_text``, chat template applied: the text the completion continues). A
  group without messages (a sender that does not fill ``prompt_messages``) gives conversational
  functions ``[{"role": "user", "content": <rendered prompt text>}]``. A multi-turn episode's or
  an agent's group gives its *initial* messages (TRL passes the dataset's prompt; the
  environment's turns are in the completion's text and ids);
- ``completions``: ``[G]`` the completions: strings (standard format), or one assistant message
  each, ``[{"role": "assistant", "content": text}]`` (conversational format);
- ``completion_ids``: ``[G]`` lists of each completion's token ids (a multi-turn episode's include
  the environment's turns, as its text does);
- ``trainer_state``: a :class:`TrainerState` with ``global_step`` (the optimizer step the prompt
  was issued for) and ``max_steps`` (``trainer.max_steps``);
- ``log_metric(name, value)`` and ``log_extra(column, values)``: TRL's logging hooks. Metrics are
  averaged per call and come back to the reward worker, which logs them as the reward term
  ``<function>/<name>`` (weight 0, so ``reward/<function>/<name>`` in each step's record); extra
  columns are accepted and dropped (rlbus's ``samples.jsonl`` has no free columns);
- every key of the example's ``info`` (the task's dataset columns, e.g. ``ground_truth``), as a
  list of ``G`` copies (TRL passes every dataset column but ``prompt``). A column named like one
  of the arguments above is dropped: the argument wins.

It returns ``G`` rewards; a ``None`` (TRL: "not applicable to this sample") scores 0 for this term
and is not an error. ``async def`` functions are run to completion. A wrong number of rewards or a
non-number fails the whole group's term (``ValueError``/``TypeError``, counted like any failed call).

Where rlbus differs, and why:

- **Standard-format ``prompts`` are the rendered text**: TRL passes a standard-format dataset's
  prompt string, which its model continues as it is; every rlbus prompt is a chat that the
  producer renders with the policy's chat template, so the text the completion continues is the
  rendered one.
- **``trainer_state`` is a small stand-in**, not ``transformers.TrainerState``: importing that
  imports torch (~5 s in every reward child on a CPU host). It has the two fields a curriculum
  reward reads (``global_step``, ``max_steps``).

Everything here runs in a reward child (JSON in, JSON out) and imports nothing heavy.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

TRL_FORMATS = {"trl:": "standard", "trl_conversational:": "conversational"}
"""Reference prefix -> TRL dataset format of the completions and prompts it is called with."""

RESERVED_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
"""TRL's own keyword arguments: an ``info`` key with one of these names is not passed."""


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """The ``trainer_state`` a TRL-style reward function receives: the fields of
    ``transformers.TrainerState`` rlbus knows at scoring time.

    Fields:
        global_step: the optimizer step the group's prompt was issued for (>= 0).
        max_steps: ``trainer.max_steps`` of the run (0 if unknown).
    """

    global_step: int
    max_steps: int


def split_trl_ref(ref: str) -> tuple[str | None, str]:
    """``(format, import path)`` of a reward reference: ``("standard", "pkg.mod:fn")`` for
    ``"trl:pkg.mod:fn"``, ``("conversational", ...)`` for ``"trl_conversational:..."``, and
    ``(None, ref)`` for any other reference (a registered name or a plain import path)."""
    for prefix, fmt in TRL_FORMATS.items():
        if ref.startswith(prefix):
            return fmt, ref[len(prefix) :]
    return None, ref


def trl_batch(
    prompt_text: str,
    completions: list[str],
    completion_ids: list[list[int]],
    *,
    global_step: int,
    max_steps: int,
    prompt_messages: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The JSON-able group data a TRL-style call needs beyond the completions and ``info`` (built by
    the reward worker, sent to the child). ``completion_ids`` is ``[G]`` lists of ints;
    ``prompt_messages`` the prompt's chat messages (``RolloutGroup.prompt_messages``; None or
    ``[]``: none, conversational functions get the text as one user message).

    Raises:
        ValueError: ``completion_ids`` does not have one entry per completion.
    """
    if len(completion_ids) != len(completions):
        raise ValueError(f"completion_ids has {len(completion_ids)} entries for {len(completions)} completions")
    return {
        "prompt": prompt_text,
        "prompt_messages": list(prompt_messages or []),
        "completion_ids": completion_ids,
        "global_step": int(global_step),
        "max_steps": int(max_steps),
    }


def conversational_prompt(batch: dict[str, Any]) -> list[dict[str, str]]:
    """The prompt as TRL's conversational format has it: the group's chat messages, or, for a group
    that carries none, ``[{"role": "user", "content": <rendered prompt text>}]``."""
    messages = batch.get("prompt_messages") or [{"role": "user", "content": batch["prompt"]}]
    return [dict(m) for m in messages]


def trl_kwargs(
    fmt: str, completions: list[str], info: dict[str, Any], batch: dict[str, Any], metrics: dict[str, list[float]]
) -> dict[str, Any]:
    """The keyword arguments of one TRL-style call (see the module docstring); ``log_metric``
    appends to ``metrics[name]``."""
    g = len(completions)

    def log_metric(name: str, value: float) -> None:
        metrics.setdefault(str(name), []).append(float(value))

    def log_extra(column: str, values: list[Any]) -> None:
        """Accepted and dropped: rlbus's samples log has no free columns."""

    kwargs: dict[str, Any] = {key: [value] * g for key, value in info.items() if key not in RESERVED_KWARGS}
    kwargs.update(
        prompts=[batch["prompt"]] * g if fmt == "standard" else [conversational_prompt(batch) for _ in range(g)],
        completions=list(completions)
        if fmt == "standard"
        else [[{"role": "assistant", "content": c}] for c in completions],
        completion_ids=[list(ids) for ids in batch["completion_ids"]],
        trainer_state=TrainerState(batch["global_step"], batch["max_steps"]),
        log_metric=log_metric,
        log_extra=log_extra,
    )
    return kwargs


def checked_rewards(out: Any, g: int, name: str) -> list[float | None]:
    """A TRL-style function's output as ``G`` floats or ``None``s (NaN stays NaN: the caller counts it).

    Raises:
        TypeError: not a sequence (a list, tuple or 1-D array), or an item that is not a real number or None.
        ValueError: not exactly ``g`` items.
    """
    if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
        raise TypeError(f"TRL-style reward {name} must return a list of {g} floats, got {type(out).__name__}")
    out = list(out)
    if len(out) != g:
        raise ValueError(f"TRL-style reward {name} returned {len(out)} rewards for {g} completions")
    rewards: list[float | None] = []
    for i, r in enumerate(out):
        if r is None:
            rewards.append(None)
        elif not isinstance(r, (int, float)) and not hasattr(r, "__float__"):  # bools count, as in TRL
            raise TypeError(f"TRL-style reward {name} returned {type(r).__name__} at index {i}, not a float or None")
        else:
            rewards.append(float(r))
    return rewards


def trl_caller(
    fn: Callable[..., Any], fmt: str, name: str
) -> Callable[[list[str], dict[str, Any], dict[str, Any]], dict[str, Any]]:
    """Wrap a TRL-style function as ``call(completions [G] str, info, batch) -> {"rewards": [G]
    float|None, "metrics": {name: mean of its logged values}}`` (JSON-able: Python's json carries
    NaN, which the scorer then counts as ``non_finite``). ``batch`` is :func:`trl_batch`'s dict.

    Raises:
        ValueError: ``fmt`` is not a TRL format.
    """
    if fmt not in TRL_FORMATS.values():
        raise ValueError(f"unknown TRL format {fmt!r}; use one of {', '.join(TRL_FORMATS.values())}")
    is_async = inspect.iscoroutinefunction(fn)

    def call(completions: list[str], info: dict[str, Any], batch: dict[str, Any]) -> dict[str, Any]:
        metrics: dict[str, list[float]] = {}
        out = fn(**trl_kwargs(fmt, completions, info, batch, metrics))
        if is_async or inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        rewards = checked_rewards(out, len(completions), name)
        return {
            "rewards": rewards,
            "metrics": {k: sum(v) / len(v) for k, v in metrics.items() if v and all(math.isfinite(x) for x in v)},
        }

    return call


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
