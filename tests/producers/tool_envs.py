"""A scripted tool-use environment for tests/producers/test_tool_episodes.py: the real
gsm8k_calculator environment (tasks.tools.ToolEnv), but each model turn's text is replaced by a
scripted one (the tiny random policy never writes tool calls), so an episode's environment turns
are real ``role: tool`` replies: results, a parse error and a tool error, then the final answer.
``BadStatsToolEnv``: the same with a malformed step statistics element (its tool calls are not
counted; the episodes run as ``ScriptedToolEnv``'s)."""

from __future__ import annotations

import json
from typing import Any

from tasks.gsm8k_calculator import ENV


def _call(expression: str) -> str:
    return f"<tool_call>\n{json.dumps({'name': 'calculator', 'arguments': {'expression': expression}})}\n</tool_call>"


SCRIPT = (
    _call("16 - 3 - 4") + "<tool_call>{not json}</tool_call>",  # a result and a parse error
    _call("1 / 0"),  # a tool error
    "#### 18",  # the answer: done
)


class ScriptedToolEnv:
    """The :mod:`tasks.env` protocol over ``tasks.gsm8k_calculator:ENV`` with turn ``k``'s text
    replaced by ``SCRIPT[k]`` (state key ``"turn"`` counts the model turns)."""

    @staticmethod
    def reset(info: dict[str, Any]) -> dict[str, Any]:
        return {**ENV.reset(info), "turn": 0}

    @staticmethod
    def step(state: dict[str, Any], text: str) -> tuple[list[dict[str, str]], bool, dict[str, Any], dict[str, Any]]:
        messages, done, new_state, stats = ENV.step(state, SCRIPT[state["turn"]])
        return messages, done, {**new_state, "turn": state["turn"] + 1}, stats

    @staticmethod
    def reward(state: dict[str, Any]) -> float:
        return ENV.reward(state)


class BadStatsToolEnv(ScriptedToolEnv):
    """:class:`ScriptedToolEnv` whose step statistics are malformed (``tool_calls`` not a list)."""

    @staticmethod
    def step(state: dict[str, Any], text: str) -> tuple[list[dict[str, str]], bool, dict[str, Any], dict[str, Any]]:
        messages, done, new_state, _ = ScriptedToolEnv.step(state, text)
        return messages, done, new_state, {"tool_calls": "three"}
