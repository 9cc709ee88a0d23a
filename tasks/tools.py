"""Tool calling for multi-turn tasks: Python functions as tools with OpenAI/HF function schemas
(``{"type": "function", "function": {"name", "description", "parameters"}}``), the Qwen/Hermes
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format, and :class:`ToolEnv`, which
answers each call with a ``{"role": "tool", "name", "content"}`` message.

What the model wrote never raises out of :meth:`ToolEnv.step`: a malformed call, an unknown tool,
bad arguments or a raising tool is answered ``"Error: ..."``. Its state is JSON (the
:mod:`tasks.env` protocol); each step also returns the turn's tool-call records. User guide:
docs/environments.md, "Tools".
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import typing
from collections.abc import Callable, Sequence
from typing import Any

# JSON schema type of each supported parameter annotation.
JSON_TYPES: dict[Any, str] = {
    str: "string",
    int: "integer",
    float: "number",
    bool: "boolean",
    list: "array",
    dict: "object",
}
# Most tool calls answered per model turn; the rest get one error message.
MAX_TOOL_CALLS_PER_TURN = 8
# Longest tool result (characters) sent back; longer ones are cut with a note.
MAX_RESULT_CHARS = 2000
ERROR_PREFIX = "Error: "

_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARGS_SECTION = re.compile(r"^\s*(?:Args|Arguments|Parameters):\s*$")
_ARG_LINE = re.compile(r"^\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")


def _docstring_parts(fn: Callable[..., Any]) -> tuple[str, dict[str, str]]:
    """(first paragraph, {argument: description}) of a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    args: dict[str, str] = {}
    in_args, last = False, None
    for line in doc.splitlines():
        if _ARGS_SECTION.match(line):
            in_args = True
            continue
        if in_args:
            m = _ARG_LINE.match(line)
            if m and len(line) - len(line.lstrip()) <= 4:
                last = m.group(1)
                args[last] = m.group(2).strip()
            elif line.strip() and line.startswith(" ") and last is not None:
                args[last] += " " + line.strip()
            elif line.strip():
                in_args = False
    return description, args


def function_schema(
    fn: Callable[..., Any], *, name: str | None = None, description: str | None = None
) -> dict[str, Any]:
    """The function schema of ``fn``: parameters typed by ``JSON_TYPES``, required when without a
    default, described by the docstring's ``Args:`` lines; the description its first paragraph.
    TypeError for ``*args``/``**kwargs`` or an annotation outside ``JSON_TYPES``."""
    hints = typing.get_type_hints(fn)
    doc_description, doc_args = _docstring_parts(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {fn.__name__!r}: *args/**kwargs cannot be described by a JSON schema")
        hint = hints.get(param.name)
        if hint not in JSON_TYPES:
            raise TypeError(
                f"tool {fn.__name__!r}: parameter {param.name!r} must be annotated with one of "
                f"{', '.join(t.__name__ for t in JSON_TYPES)}, got {hint!r}"
            )
        properties[param.name] = {"type": JSON_TYPES[hint]}
        if param.name in doc_args:
            properties[param.name]["description"] = doc_args[param.name]
        if param.default is param.empty:
            required.append(param.name)
    return {
        "type": "function",
        "function": {
            "name": name or fn.__name__,
            "description": description if description is not None else doc_description,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


@dataclasses.dataclass(frozen=True)
class Tool:
    """``fn``, called with a call's keyword arguments, and its ``schema`` (:func:`function_schema`)."""

    fn: Callable[..., Any]
    schema: dict[str, Any]

    @property
    def name(self) -> str:
        """The name the model calls it by."""
        return self.schema["function"]["name"]

    @classmethod
    def from_function(cls, fn: Callable[..., Any], *, name: str | None = None, description: str | None = None) -> Tool:
        """A tool over ``fn`` with its :func:`function_schema`; TypeError as that."""
        return cls(fn, function_schema(fn, name=name, description=description))


def tool_schemas(tools: Sequence[Tool]) -> tuple[dict[str, Any], ...]:
    """The schemas for ``Task.tools``, in order; ValueError when two tools share a name."""
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    return tuple(t.schema for t in tools)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call."""

    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """An unreadable ``<tool_call>`` block; ``message`` tells the model why."""

    message: str


def _parse_block(body: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return ToolCallError(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError('the tool call must be a JSON object {"name": <tool name>, "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCallError(f"the arguments of {obj['name']!r} must be a JSON object")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """The calls of a model turn, in order: a :class:`ToolCall` per well-formed block, a
    :class:`ToolCallError` per malformed or unclosed one; ``[]``: the turn is an answer.
    TypeError when ``text`` is not a str."""
    if not isinstance(text, str):
        raise TypeError(f"parse_tool_calls needs the model's text as str, got {type(text).__name__}")
    out: list[ToolCall | ToolCallError] = [_parse_block(m.group(1).strip()) for m in _CALL_BLOCK.finditer(text)]
    if "<tool_call>" in _CALL_BLOCK.sub("", text):
        out.append(ToolCallError("a <tool_call> was not closed with </tool_call>"))
    return out


def _check_arguments(schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    """Why ``args`` do not fit ``schema``, or None."""
    props = schema.get("properties", {})
    missing = [k for k in schema.get("required", []) if k not in args]
    unexpected = [k for k in args if k not in props]
    if missing or unexpected:
        return f"missing arguments {missing}, unexpected arguments {unexpected}; expected {sorted(props)}"
    for key, value in args.items():
        want = props[key].get("type")
        py = {v: k for k, v in JSON_TYPES.items()}.get(want)
        ok = py is None or (isinstance(value, py) and not (isinstance(value, bool) and py is not bool))
        if want == "number" and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            return f"argument {key!r} must be of type {want}, got {type(value).__name__}"
    return None


def _result_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " ... (cut)"


def answer_tool_calls(
    tools: Sequence[Tool], calls: Sequence[ToolCall | ToolCallError]
) -> tuple[list[dict[str, str]], list[dict[str, str | None]]]:
    """``(messages, records)``: one ``{"role": "tool", "name", "content"}`` per call (at most
    ``MAX_TOOL_CALLS_PER_TURN``, then one error for the rest; non-str results as JSON; failures
    ``"Error: ..."``), and one ``{"name", "error": None or a tasks.env.TOOL_ERRORS kind}`` per call."""
    by_name = {t.name: t for t in tools}
    out: list[dict[str, str]] = []
    records: list[dict[str, str | None]] = []
    for call in calls[:MAX_TOOL_CALLS_PER_TURN]:
        if isinstance(call, ToolCallError):
            out.append({"role": "tool", "name": "error", "content": ERROR_PREFIX + call.message})
            records.append({"name": None, "error": "parse_error"})
            continue
        tool, error = by_name.get(call.name), None
        if tool is None:
            content, error = f"{ERROR_PREFIX}unknown tool {call.name!r}; tools: {sorted(by_name)}", "unknown_tool"
        elif (why := _check_arguments(tool.schema["function"]["parameters"], call.arguments)) is not None:
            content, error = f"{ERROR_PREFIX}{call.name}: {why}", "bad_arguments"
        else:
            try:
                content = _result_text(tool.fn(**call.arguments))
            except Exception as exc:  # a tool's failure is the model's feedback, never the env's
                content, error = f"{ERROR_PREFIX}{call.name}: {type(exc).__name__}: {exc}", "tool_raised"
        out.append({"role": "tool", "name": call.name, "content": content})
        records.append({"name": call.name, "error": error})
    if len(calls) > MAX_TOOL_CALLS_PER_TURN:
        out.append(
            {
                "role": "tool",
                "name": "error",
                "content": f"{ERROR_PREFIX}at most {MAX_TOOL_CALLS_PER_TURN} tool calls per turn; "
                f"{len(calls) - MAX_TOOL_CALLS_PER_TURN} were not run",
            }
        )
        records += [
            {"name": c.name if isinstance(c, ToolCall) else None, "error": "too_many_calls"}
            for c in calls[MAX_TOOL_CALLS_PER_TURN:]
        ]
    return out, records


def run_tool_calls(tools: Sequence[Tool], calls: Sequence[ToolCall | ToolCallError]) -> list[dict[str, str]]:
    """The messages of :func:`answer_tool_calls`."""
    return answer_tool_calls(tools, calls)[0]


class ToolEnv:
    """A :mod:`tasks.env` environment: a turn with tool calls gets their results, a turn without is
    the final answer (done). Reward: ``answer_reward(answer, info)`` + ``format_weight`` when the
    answer passes ``answer_format`` and no call erred; 0 without an answer. State (JSON):
    ``{"info", "answer", "tool_calls", "tool_errors"}``.
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        answer_reward: Callable[[str, dict], float],
        *,
        format_weight: float = 0.0,
        answer_format: Callable[[str], bool] | None = None,
    ) -> None:
        self.tools = list(tools)
        self.schemas = tool_schemas(self.tools)
        self.answer_reward, self.format_weight, self.answer_format = answer_reward, format_weight, answer_format

    def reset(self, info: dict[str, Any]) -> dict[str, Any]:
        """The initial state; TypeError when ``info`` is not a dict."""
        if not isinstance(info, dict):
            raise TypeError(f"a tool environment needs info as a dict, got {type(info).__name__}")
        return {"info": info, "answer": None, "tool_calls": 0, "tool_errors": 0}

    def step(
        self, state: dict[str, Any], text: str
    ) -> tuple[list[dict[str, str]], bool, dict[str, Any], dict[str, Any]]:
        """Answer the calls in ``text``, or take it as the final answer; 4th element: the statistics."""
        calls = parse_tool_calls(text)
        if not calls:
            return [], True, {**state, "answer": text}, {"tool_calls": []}
        messages, records = answer_tool_calls(self.tools, calls)
        errors = sum(m["content"].startswith(ERROR_PREFIX) for m in messages)
        return (
            messages,
            False,
            {**state, "tool_calls": state["tool_calls"] + len(calls), "tool_errors": state["tool_errors"] + errors},
            {"tool_calls": records},
        )

    def reward(self, state: dict[str, Any]) -> float:
        """The episode's reward (class docstring)."""
        if state["answer"] is None:
            return 0.0
        clean = state["tool_errors"] == 0 and (self.answer_format is None or bool(self.answer_format(state["answer"])))
        return float(self.answer_reward(state["answer"], state["info"])) + (self.format_weight if clean else 0.0)
