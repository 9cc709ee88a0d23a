"""The environment protocol of multi-turn tasks, and :class:`EnvCalls`, which runs environments isolated.

A multi-turn task (``Task.env`` set) names an environment by import path
``"package.module:Object"``; ``Object`` has three functions (static methods of a class, or
attributes of a module-level object), each called with JSON values only::

    reset(info: dict) -> state: dict
    step(state: dict, text: str) -> [env_messages: list[{"role", "content"}], done: bool, state: dict]
    reward(state: dict) -> float

``step`` may return a fourth element, a dict of per-turn statistics the producer counts
(:mod:`producers.turn_metrics`); today one key, the turn's tool calls in order::

    [env_messages, done, state, {"tool_calls": [{"name": str | None, "error": str | None}, ...]}]

``name``: the tool called (None: the call could not be read); ``error``: None for a call that
returned, else one of :data:`TOOL_ERRORS`. A malformed statistics element (not a dict, a record
of another shape, an unknown error kind, more than ``MAX_TOOL_RECORDS`` records) is ignored and
flagged (:attr:`EnvResult.bad_stats`, counted by the producer); the step's other elements stand.

The episode (:mod:`producers.episodes`) starts from the task's prompt messages (the prompt source
renders them, as for a single-turn task: ``reset`` only builds the state), then per model turn
calls ``step`` with the model's text until ``done`` or ``Task.max_turns`` model turns, then
``reward``. Environments are state-passing (the state dict is the whole episode memory and goes
to every call) so that each call is a plain function call any isolated child can make: no call
is tied to a child, a killed child loses nothing but its call, and the same shape fits a remote
or verifiers-style environment later (its state travels the same way).

Isolation: :class:`EnvCalls` makes the calls in child processes (:class:`tasks.isolated_calls.IsolatedCalls`,
the machinery of the reward functions): a call that raises, hangs past ``timeout_s``, crashes its
child or returns a malformed result ends that episode with reward 0 and a reason (the error
label: exception type name, ``"timeout"``, ``"crash"``, ``"bad_result"``); the producer lives on.
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
    """One environment call's outcome: ``value`` (``state`` for reset; ``(messages, done, state)``
    for step; a finite float for reward) or ``error`` (the label; ``value`` None). A step's
    statistics: ``tool_calls`` (``(name, error)`` per tool call, module docstring) and
    ``bad_stats`` (True: its statistics element was malformed and ignored)."""

    value: Any
    error: str | None = None
    tool_calls: tuple[tuple[str | None, str | None], ...] = ()
    bad_stats: bool = False


def env_refs(env: str) -> list[str]:
    """The three function refs of environment ``env``: ``[env.reset, env.step, env.reward]``.

    Raises:
        ValueError: ``env`` is not shaped like ``"package.module:Object"``.
    """
    module_name, _, attr = env.partition(":")
    if not module_name or not attr:
        raise ValueError(f"environment import path={env!r} must look like 'package.module:Object'")
    return [f"{env}.{fn}" for fn in FUNCTIONS]


def resolve_env_fn(ref: str) -> Callable[..., Any]:
    """The callable at ``ref`` (``"package.module:Object.step"``); the children's resolver.

    Raises:
        ValueError: as :func:`tasks.import_path.import_callable`.
    """
    return import_callable(ref, "environment")


def step_stats(stats: Any) -> tuple[tuple[str | None, str | None], ...] | None:
    """The ``(name, error)`` tool-call records of a step's statistics element (module
    docstring), or None if it is malformed. Never raises."""
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
    """Validate one call's JSON result for ``fn``; a malformed one becomes ``"bad_result"``."""
    if result.error is not None:
        return EnvResult(None, result.error)
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
    return EnvResult(None, "bad_result")


class EnvCalls:
    """Calls the functions of several environments in isolated child processes.

    Args:
        envs: environment import paths (each resolved in every child at start).
        timeout_s: most seconds one call may take (``"timeout"`` past it; the child is replaced).
        num_procs: child processes; the calls of one :meth:`call` run in parallel across them.

    Raises:
        ValueError: a malformed path, or one whose functions do not resolve (in the children).
        RuntimeError: a child did not start.
    """

    def __init__(self, envs: Sequence[str], *, timeout_s: float = 10.0, num_procs: int = 2) -> None:
        self.envs = list(dict.fromkeys(envs))
        refs = [ref for env in self.envs for ref in env_refs(env)]
        self._calls = IsolatedCalls(
            refs, resolver="tasks.env:resolve_env_fn", timeout_s=timeout_s, num_procs=num_procs, what="environment"
        )

    def call(self, env: str, fn: str, args: Sequence[list]) -> list[EnvResult]:
        """Call ``env``'s function ``fn`` (``"reset"``, ``"step"`` or ``"reward"``) once per
        argument list in ``args``; results in order, never raising for a failing environment.

        Raises:
            ValueError: ``env`` is not one of this pool's environments, or ``fn`` is unknown.
        """
        if env not in self.envs or fn not in FUNCTIONS:
            raise ValueError(f"unknown environment {env!r} or function {fn!r}; known: {self.envs}, {FUNCTIONS}")
        k = self.envs.index(env) * len(FUNCTIONS) + FUNCTIONS.index(fn)
        return [_checked(fn, r) for r in self._calls.run([(k, list(a)) for a in args])]

    def pids(self) -> list[int]:
        """Process ids of the children (for tests)."""
        return self._calls.pids()

    def close(self) -> None:
        """Stop the children; idempotent."""
        self._calls.close()
