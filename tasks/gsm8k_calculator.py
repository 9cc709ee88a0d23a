"""The ``gsm8k_calculator`` task: GSM8K problems solved over several turns with a calculator tool.

Data, splits and answer check are :mod:`tasks.gsm8k`'s (``task.dataset`` applies). Each model turn
calls :func:`calculator` (Qwen/Hermes ``<tool_call>``, :mod:`tasks.tools`) or is the final answer;
at most ``CALCULATOR_MAX_TURNS``. Reward (term ``env``, in [0, 1.1]): :func:`tasks.gsm8k.gsm8k_reward`
of the answer, + ``CALCULATOR_FORMAT_WEIGHT`` for a ``#### <number>`` line with no tool error.
The system prompt states the call format because the tiny default policy's template ignores
``tools``; that policy cannot do GSM8K (reward ~0): the task is for tool-trained instruct models.
:func:`calculator` evaluates an :mod:`ast` of numbers and bounded operators, never ``eval``.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import TYPE_CHECKING

from tasks.datasets import file_task
from tasks.gsm8k import DATA_DIR, GSM8K_FIELDS, gsm8k_example, gsm8k_reward
from tasks.task import Task
from tasks.tools import Tool, ToolEnv

if TYPE_CHECKING:
    from configs.rollout import DatasetConfig

CALCULATOR_MAX_TURNS = 4
CALCULATOR_FORMAT_WEIGHT = 0.1
CALCULATOR_SYSTEM_PROMPT = (
    "Solve the math problem. For arithmetic, call the calculator tool: "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 * (3 + 4)"}}</tool_call> '
    "and read its result in the next turn. When you know the answer, reply without a tool call "
    "and end with the line: #### <number>"
)
MAX_EXPRESSION_CHARS = 200
MAX_EXPRESSION_DEPTH = 32
# Largest magnitude a result (or any intermediate value) may have.
MAX_MAGNITUDE = 1e75

_ANSWER_LINE = re.compile(r"^\s*####\s*-?\$?[0-9]", re.MULTILINE)

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _checked(value: float | int) -> float | int:
    if (
        isinstance(value, complex)
        or (isinstance(value, float) and not math.isfinite(value))
        or abs(value) > MAX_MAGNITUDE
    ):
        raise ValueError("the result is too large or not a real number")
    return value


def _eval(node: ast.AST, depth: int) -> float | int:
    if depth > MAX_EXPRESSION_DEPTH:
        raise ValueError(f"the expression is nested deeper than {MAX_EXPRESSION_DEPTH}")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, depth + 1))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            if abs(right) > 1000 or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 75):
                raise ValueError("the power is too large")
            if left == 0 and right < 0:
                raise ValueError("division by zero")
        elif isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("'^' is not a power here: write ** for powers")
    raise ValueError(f"only numbers, + - * / // % **, and parentheses are allowed, not {type(node).__name__}")


def _format(value: float | int) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value) if isinstance(value, int) else format(value, ".10g")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: numbers, + - * / // % ** and parentheses, e.g. "(48 / 2) * 3 + 1.5"; no
            thousands separators.

    Raises:
        ValueError: the expression is longer than ``MAX_EXPRESSION_CHARS``, does not parse, uses
            anything but numbers and those operators, divides by zero or gives a result beyond
            ``MAX_MAGNITUDE``.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse the expression: {exc.msg}") from None
    return _format(_eval(tree.body, 0))


def has_answer_line(text: str) -> bool:
    """True when ``text`` has a line ``#### <number>``."""
    return _ANSWER_LINE.search(text) is not None


CALCULATOR = Tool.from_function(calculator)
ENV = ToolEnv([CALCULATOR], gsm8k_reward, format_weight=CALCULATOR_FORMAT_WEIGHT, answer_format=has_answer_line)
"""The environment (``Task.env = "tasks.gsm8k_calculator:ENV"``)."""


def make_task(dataset: DatasetConfig | None = None) -> Task:
    """The registered ``gsm8k_calculator`` task (environment :data:`ENV`, no reward functions);
    ValueError as :func:`tasks.gsm8k.make_task`."""
    return file_task(
        "gsm8k_calculator",
        dataset,
        DATA_DIR,
        GSM8K_FIELDS,
        gsm8k_example,
        system_prompt=CALCULATOR_SYSTEM_PROMPT,
        rewards=(),
        env="tasks.gsm8k_calculator:ENV",
        max_turns=CALCULATOR_MAX_TURNS,
        tools=ENV.schemas,
    )
