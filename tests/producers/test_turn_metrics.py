"""Tool-call counting in the producer (producers.turn_metrics), read back from the Prometheus
registry: label values are the task's tool names or ``other`` (never a name from the model's
text), every call counts once and a failed one once more by kind, and an agent turn's
``<tool_call>`` blocks are read as calls (unreadable ones as parse errors)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from producers.turn_metrics import OTHER_TOOL, count_tool_calls, preinit_tools, schema_names, text_tool_calls
from tasks.env import TOOL_ERRORS


def _value(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


def test_calls_count_by_declared_tool_or_other_and_errors_by_kind():
    preinit_tools(["tm_calc"])
    assert all(
        _value("rlbus_producer_tool_errors_total", tool=t, error=e) >= 0
        for t in ("tm_calc", OTHER_TOOL)
        for e in TOOL_ERRORS
    )
    before = {
        (t, e): _value("rlbus_producer_tool_errors_total", tool=t, error=e)
        for t in ("tm_calc", OTHER_TOOL)
        for e in TOOL_ERRORS
    }
    calls_before = {t: _value("rlbus_producer_tool_calls_total", tool=t) for t in ("tm_calc", OTHER_TOOL)}
    known = schema_names([{"type": "function", "function": {"name": "tm_calc"}}, {"bogus": 1}, "x"])
    assert known == {"tm_calc"}
    records = [
        ("tm_calc", None),
        ("tm_calc", "tool_raised"),
        ("made_up_by_the_model", "unknown_tool"),
        (None, "parse_error"),
    ]
    assert count_tool_calls(records, known) == 4
    assert REGISTRY.get_sample_value("rlbus_producer_tool_calls_total", {"tool": "made_up_by_the_model"}) is None
    assert _value("rlbus_producer_tool_calls_total", tool="tm_calc") - calls_before["tm_calc"] == 2
    assert _value("rlbus_producer_tool_calls_total", tool=OTHER_TOOL) - calls_before[OTHER_TOOL] == 2
    grown = {k for k, v in before.items() if _value("rlbus_producer_tool_errors_total", tool=k[0], error=k[1]) != v}
    assert grown == {("tm_calc", "tool_raised"), (OTHER_TOOL, "unknown_tool"), (OTHER_TOOL, "parse_error")}


def test_an_agent_turns_tool_call_blocks_are_read_as_calls():
    text = (
        'Let me compute.<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'
        "<tool_call>{nope}</tool_call> and <tool_call>unclosed"
    )
    assert text_tool_calls(text) == [("calc", None), (None, "parse_error"), (None, "parse_error")]
    assert text_tool_calls("#### 18") == []
