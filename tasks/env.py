"""The environment protocol of multi-turn tasks, and :class:`EnvCalls`, which runs environments isolated.

``Task.env`` names ``"package.module:Object"`` whose three functions take and return JSON only::

    reset(info: dict) -> state: dict
    step(state: dict, text: str) -> [env_messages: [{"role", "content"}], done: bool, state: dict]
                                     (+ optional 4th: {"tool_calls": [{"name": str | None, "error": str | None}]})
    reward(state: dict) -> float

The state is the whole episode memory, so no call is tied to a child. A tool-call ``error`` is None
or one of :data:`TOOL_ERRORS`; a malformed statistics element is ignored and flagged
(:attr:`EnvResult.bad_stats`). A failed call (error label: exception type name, ``"timeout"``,
``"crash"``, ``"bad_result"``) ends its episode with reward 0. The episode loop is
:mod:`producers.episodes`; the user guide docs/environments.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from tasks.import_path import import_callable
from tasks.isolated_calls import CallResult, IsolatedCalls

FUNCTIONS = ("reset", "step", "reward")
ENV_ERRORS = ("timeout", "crash", "bad_result")  # plus exception type names, as raised
# Kinds of a failed tool call in a step's statistics (tasks.tools: all but "timeout", for
# environments whose tools run with a deadline).
TOOL_ERRORS = ("parse_error", "unknown_tool", "bad_arguments", "tool_raised", "too_many_calls", "timeout")
MAX_TOOL_RECORDS = 256  # per step; more is a malformed statistics element
MAX_TOOL_NAME_CHARS = 128


class Environment(Protocol):
    """What ``Task.env`` names (see the module docstring for the shapes)."""

    def reset(self, info: dict) -> dict: ...

    def step(self, state: dict, text: str) -> tuple[list[dict], bool, dict] | tuple[list[dict], bool, dict, dict]: ...

    def reward(self, state: dict) -> float: ...


@dataclasses.dataclass(frozen=True)
class EnvResult:
    """``value``: ``state`` (reset), ``(messages, done, state)`` (step) or a finite float (reward); or
    ``error``, the label (``value`` None), and ``message``, what failed. A step's ``tool_calls`` are
    ``(name, error)`` records; ``bad_stats``: its statistics element was malformed and ignored."""

    value: Any
    error: str | None = None
    message: str = ""
    tool_calls: tuple[tuple[str | None, str | None], ...] = ()
    bad_stats: bool = False


def env_refs(env: str) -> list[str]:
    """``[env.reset, env.step, env.reward]``; ValueError unless ``env`` is ``"package.module:Object"``."""
    module_name, _, attr = env.partition(":")
    if not module_name or not attr:
        raise ValueError(f"environment import path={env!r} must look like 'package.module:Object'")
    return [f"{env}.{fn}" for fn in FUNCTIONS]


def resolve_env_fn(ref: str) -> Callable[..., Any]:
    """The callable at ``ref`` (the children's resolver); ValueError as :func:`~tasks.import_path.import_callable`."""
    return import_callable(ref, "environment")


def step_stats(stats: Any) -> tuple[tuple[str | None, str | None], ...] | None:
    """The ``(name, error)`` records of a step's statistics element, or None if malformed."""
    if not isinstance(stats, dict):
        return None
    records = stats.get("tool_calls", [])
    if not isinstance(records, list) or len(records) > MAX_TOOL_RECORDS:
        return None
    out = []
    for r in records:
        if not (isinstance(r, dict) and set(r) <= {"name", "error"}):
            return None
        name, error = r.get("name"), r.get("error")
        if not (name is None or (isinstance(name, str) and len(name) <= MAX_TOOL_NAME_CHARS)):
            return None
        if not (error is None or error in TOOL_ERRORS):
            return None
        out.append((name, error))
    return tuple(out)


def _checked(fn: str, result: CallResult) -> EnvResult:
    """One call's result checked for ``fn``; a malformed one is ``"bad_result"``."""
    if result.error is not None:
        return EnvResult(None, result.error, result.message)
    v = result.value
    if fn == "reset" and isinstance(v, dict):
        return EnvResult(v)
    if (
        fn == "step"
        and isinstance(v, list)
        and len(v) in (3, 4)
        and isinstance(v[1], bool)
        and isinstance(v[2], dict)
        and isinstance(v[0], list)
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in v[0]
        )
    ):
        tool_calls = step_stats(v[3]) if len(v) == 4 else ()
        return EnvResult((v[0], v[1], v[2]), tool_calls=tool_calls or (), bad_stats=tool_calls is None)
    if fn == "reward" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return EnvResult(float(v))
    return EnvResult(None, "bad_result", f"{fn} returned a malformed result: {str(v)[:100]}")


class EnvCalls:
    """The functions of environments ``envs`` (import paths) in ``num_procs`` isolated children;
    ``timeout_s`` bounds one call, seconds. ValueError for a path that does not resolve,
    RuntimeError for a child that did not start."""

    def __init__(self, envs: Sequence[str], *, timeout_s: float = 10.0, num_procs: int = 2) -> None:
        self.envs = list(dict.fromkeys(envs))
        refs = [ref for env in self.envs for ref in env_refs(env)]
        self._calls = IsolatedCalls(
            refs, resolver="tasks.env:resolve_env_fn", timeout_s=timeout_s, num_procs=num_procs, what="environment"
        )

    def call(self, env: str, fn: str, args: Sequence[list]) -> list[EnvResult]:
        """``env``'s ``fn`` (reset, step or reward) once per argument list, results in order; never
        raises for a failing environment. ValueError for an unknown ``env`` or ``fn``."""
        if env not in self.envs or fn not in FUNCTIONS:
            raise ValueError(f"unknown environment {env!r} or function {fn!r}; known: {self.envs}, {FUNCTIONS}")
        k = self.envs.index(env) * len(FUNCTIONS) + FUNCTIONS.index(fn)
        return [_checked(fn, r) for r in self._calls.run([(k, list(a)) for a in args])]

    def pids(self) -> list[int]:
        """Process ids of the children."""
        return self._calls.pids()

    def close(self) -> None:
        """Stop the children; idempotent."""
        self._calls.close()
