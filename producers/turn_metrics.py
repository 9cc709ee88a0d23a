"""Tool-call metrics of multi-turn episodes: calls and failed calls per tool, calls per episode.

Environment episodes report ``(name, error)`` per call in their step statistics (:mod:`tasks.env`); agent
episodes only show the ``<tool_call>`` blocks the endpoint returned (unreadable: ``parse_error``). Labels stay
bounded: ``tool`` is a declared tool name or :data:`OTHER_TOOL`, never text from the model; ``error`` one of
:data:`tasks.env.TOOL_ERRORS`. Label sets are created at 0 (:func:`preinit_tools`) so Grafana shows 0, not no data.
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
    """The tool names of ``{"function": {"name": ...}}`` schemas; other shapes are skipped."""
    names = set()
    for s in schemas or ():
        fn = s.get("function") if isinstance(s, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return frozenset(names)


def count_tool_calls(records: Sequence[tuple[str | None, str | None]], known: frozenset[str]) -> int:
    """Count one turn's ``(name, error)`` records (names outside ``known``: :data:`OTHER_TOOL`); how many."""
    for name, error in records:
        tool = name if name in known else OTHER_TOOL
        TOOL_CALLS.labels(tool).inc()
        if error is not None:
            TOOL_CALL_ERRORS.labels(tool, error).inc()
    return len(records)


def text_tool_calls(text: str) -> list[tuple[str | None, str | None]]:
    """``(name, None)`` per readable ``<tool_call>`` block of ``text``, ``(None, "parse_error")`` per other."""
    return [(None, "parse_error") if isinstance(c, ToolCallError) else (c.name, None) for c in parse_tool_calls(text)]
