"""Tool-call metrics of multi-turn episodes: calls and failed calls per tool, calls per episode.

Where the numbers come from:

* Environment episodes (:mod:`producers.episodes`): a ``step`` may return statistics with the
  turn's tool calls, ``(name, error)`` per call (protocol and validation in :mod:`tasks.env`;
  :class:`tasks.tools.ToolEnv` always does). A malformed statistics element is ignored and counted
  in ``rlbus_producer_env_bad_stats_total``; the episode goes on.
* Agent episodes (:mod:`producers.agents`): the agent runs its tools itself, so only the calls
  are visible: the ``<tool_call>`` blocks of the assistant texts the endpoint returned
  (:func:`tasks.tools.parse_tool_calls`); a block that cannot be read counts as a
  ``parse_error``, the other failures are the agent's to see.

Invariants:

* Label values are bounded: ``tool`` is one of the task's tool names (``Task.tools``) or
  :data:`OTHER_TOOL` (a call that could not be read, a tool the task does not declare, a task
  without schemas), never a name taken from the model's text; ``error`` is one of
  :data:`tasks.env.TOOL_ERRORS`.
* Every call counts once in ``rlbus_producer_tool_calls_total{tool}``; a failed one also once in
  ``rlbus_producer_tool_errors_total{tool, error}``.
* Labels are pre-initialized (:func:`preinit_tools`, at producer start for the run's tool tasks,
  and ``other`` at import) so that Grafana shows 0 rather than no data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import Counter, Histogram

from tasks.env import TOOL_ERRORS
from tasks.tools import ToolCallError, parse_tool_calls

OTHER_TOOL = "other"
"""The ``tool`` label of calls not made to one of the task's declared tools."""

TOOL_CALLS = Counter(
    "rlbus_producer_tool_calls_total",
    "Tool calls made by model turns of multi-turn episodes, by tool (other: unreadable or undeclared)",
    ["tool"],
)
TOOL_CALL_ERRORS = Counter(
    "rlbus_producer_tool_errors_total",
    "Tool calls answered with an error, by tool and error kind (parse_error, unknown_tool, "
    "bad_arguments, tool_raised, too_many_calls, timeout)",
    ["tool", "error"],
)
EPISODE_TOOL_CALLS = Histogram(
    "rlbus_producer_episode_tool_calls",
    "Tool calls per episode of a tool-use task",
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32),
)
BAD_STATS = Counter(
    "rlbus_producer_env_bad_stats_total",
    "Environment step results whose statistics element was malformed (ignored; the step stands)",
)


def preinit_tools(names: Iterable[str]) -> None:
    """Create the label sets of tools ``names`` (and :data:`OTHER_TOOL`) at 0."""
    for name in (*names, OTHER_TOOL):
        TOOL_CALLS.labels(name)
        for error in TOOL_ERRORS:
            TOOL_CALL_ERRORS.labels(name, error)


preinit_tools(())


def schema_names(schemas: Iterable[dict] | None) -> frozenset[str]:
    """The tool names of function schemas (``Task.tools``; ``{"function": {"name": ...}}``);
    schemas of another shape are skipped."""
    names = set()
    for s in schemas or ():
        fn = s.get("function") if isinstance(s, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


def count_tool_calls(records: Sequence[tuple[str | None, str | None]], known: frozenset[str]) -> int:
    """Count one turn's tool calls ``records`` (``(name, error)``, :attr:`tasks.env.EnvResult.tool_calls`);
    ``known``: the task's tool names (others are :data:`OTHER_TOOL`). Returns how many calls."""
    for name, error in records:
        tool = name if name in known else OTHER_TOOL
        TOOL_CALLS.labels(tool).inc()
        if error is not None:
            TOOL_CALL_ERRORS.labels(tool, error).inc()
    return len(records)


def text_tool_calls(text: str) -> list[tuple[str | None, str | None]]:
    """The ``(name, error)`` records of the ``<tool_call>`` blocks in a model turn's ``text``, as
    seen without running them: ``(name, None)`` per readable call, ``(None, "parse_error")`` per
    unreadable one."""
    return [(None, "parse_error") if isinstance(c, ToolCallError) else (c.name, None) for c in parse_tool_calls(text)]
