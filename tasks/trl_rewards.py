"""TRL-style reward functions (references ``trl:pkg.mod:fn``, ``trl_conversational:...``), called
once per group as TRL's ``GRPOTrainer._calculate_rewards`` calls them: ``fn(prompts, completions,
completion_ids, trainer_state, log_metric, log_extra, **info columns) -> [G] float | None``.

The arguments, their formats and rlbus's departures from TRL (standard-format ``prompts`` are the
rendered text; ``trainer_state`` is a two-field stand-in, as ``transformers`` would import torch in
every reward child) are in docs/rewards.md. A multi-turn group's ``completion_ids`` include the
environment's turns, as its text does; an ``info`` key named like an argument is dropped. Runs in
reward children (JSON in and out) and imports nothing heavy.
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
    """``trainer_state``: ``global_step`` (the step the prompt was issued for), ``max_steps`` (0: unknown)."""

    global_step: int
    max_steps: int


def split_trl_ref(ref: str) -> tuple[str | None, str]:
    """``(format, import path)``: ``("standard", "pkg.mod:fn")`` for ``"trl:pkg.mod:fn"``, ``(None, ref)``
    for a reference that is not TRL-style."""
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
    """The JSON group data of a TRL-style call beyond completions and ``info``; ``completion_ids``:
    ``[G]`` lists of int. ValueError unless it has one entry per completion."""
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
    """The group's chat messages, else ``[{"role": "user", "content": <rendered prompt text>}]``."""
    messages = batch.get("prompt_messages") or [{"role": "user", "content": batch["prompt"]}]
    return [dict(m) for m in messages]


def trl_kwargs(
    fmt: str, completions: list[str], info: dict[str, Any], batch: dict[str, Any], metrics: dict[str, list[float]]
) -> dict[str, Any]:
    """The keyword arguments of one call; ``log_metric`` appends to ``metrics[name]``."""
    g = len(completions)

    def log_metric(name: str, value: float) -> None:
        metrics.setdefault(str(name), []).append(float(value))

    def log_extra(column: str, values: list[Any]) -> None:
        """Dropped: rlbus's samples log has no free columns."""

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
    """The output as ``g`` floats or Nones (NaN kept). TypeError for a non-sequence or an item that is
    neither a real number nor None; ValueError for another length."""
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
    """``fn`` as ``call(completions [G], info, batch) -> {"rewards": [G] float | None, "metrics":
    {name: mean}}`` (JSON; NaN is counted ``non_finite`` by the scorer). ValueError for an unknown ``fmt``."""
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
