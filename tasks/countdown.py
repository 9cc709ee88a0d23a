"""The ``countdown`` task (the numbers round of the TV game; TinyZero's "Countdown-Tasks-3to4"):
reach a target with some of the given numbers, each at most once, and ``+ - * /``.

Problems are synthetic: 3 or 4 numbers combined in random order by random operators, redrawn until
the value is an integer in ``[1, MAX_TARGET]`` (so reachable, :attr:`CountdownProblem.solution`);
splits by :func:`tasks.task.hash_split` of the sorted numbers and target. No system prompt.

The answer (last ``<answer>`` tag, else the last line; a trailing ``= <target>`` dropped) is never
given to ``eval``: a recursive-descent parser accepts only

    expr := term (("+" | "-") term)*;  term := factor (("*" | "/") factor)*;
    factor := "-" factor | "(" expr ")" | INTEGER                      (ASCII digits; × ÷ read as * /)

evaluated exactly with ``Fraction``, at most ``MAX_EXPRESSION_CHARS`` long and ``MAX_DEPTH`` deep, so
a hostile completion costs microseconds. Anything else scores 0.
"""

from __future__ import annotations

import operator
import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tasks.task import Example, Task, check_request, hash_split, strip_end_of_turn

NUM_NUMBERS = (3, 4)
MIN_NUMBER = 1
MAX_NUMBER = 99
MAX_TARGET = 999
_OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}

PROMPT_TEMPLATE = (
    "Using the numbers {numbers}, write an arithmetic expression that equals {target}. "
    "You may use +, -, *, / and parentheses; each number may be used at most once, and you do "
    "not have to use all of them. Think step by step, then give only the expression inside "
    "<answer></answer>, for example <answer>(1 + 2) * 3</answer>."
)


@dataclass(frozen=True)
class CountdownProblem:
    """One problem: ``numbers`` (in prompt order), ``target`` and a ``solution`` expression."""

    numbers: tuple[int, ...]
    target: int
    solution: str

    def key(self) -> str:
        """Canonical key (sorted numbers and target) that fixes the split."""
        return ",".join(map(str, sorted(self.numbers))) + f"->{self.target}"


def split_of(problem: CountdownProblem) -> str:
    """The split (``"train"`` or ``"eval"``) that owns ``problem``, fixed by its key's sha256."""
    return hash_split(problem.key())


def sample_problem(rng: random.Random) -> CountdownProblem:
    """Draw one problem from ``rng``."""
    while True:
        numbers = [rng.randint(MIN_NUMBER, MAX_NUMBER) for _ in range(rng.choice(NUM_NUMBERS))]
        items = [(Fraction(n), str(n)) for n in numbers]
        while len(items) > 1:
            (a, a_text), (b, b_text) = (items.pop(rng.randrange(len(items))) for _ in range(2))
            op = rng.choice("+-*/" if b != 0 else "+-*")
            items.append((_OPERATORS[op](a, b), f"({a_text} {op} {b_text})"))
        value, text = items[0]
        if value.denominator == 1 and 1 <= value <= MAX_TARGET:
            return CountdownProblem(tuple(numbers), int(value), text[1:-1])


def countdown_problems(split: str, num_examples: int, seed: int) -> list[CountdownProblem]:
    """``num_examples`` distinct problems of ``split``, deterministic in ``seed`` (a prefix does not
    depend on ``num_examples``). ValueError for an invalid ``split`` or ``num_examples``."""
    if not isinstance(num_examples, int):
        raise ValueError(f"num_examples must be an int >= 0, got {num_examples!r}")
    check_request(split, num_examples)
    # A distinct stream per split, so "train" and "eval" with the same seed do not share a prefix.
    rng = random.Random(f"countdown/{split}/{seed}")
    seen: set[str] = set()
    problems: list[CountdownProblem] = []
    while len(problems) < num_examples:
        problem = sample_problem(rng)
        if problem.key() in seen or split_of(problem) != split:
            continue
        seen.add(problem.key())
        problems.append(problem)
    return problems


def countdown_examples(split: str, num_examples: int, seed: int) -> list[Example]:
    """Examples ``{"id": "countdown/<split>/<seed>/<i>", "prompt", "info"}`` of :func:`countdown_problems`."""
    return [
        {
            "id": f"countdown/{split}/{seed}/{i}",
            "prompt": PROMPT_TEMPLATE.format(numbers=", ".join(map(str, problem.numbers)), target=problem.target),
            "info": {"numbers": list(problem.numbers), "target": problem.target},
        }
        for i, problem in enumerate(countdown_problems(split, num_examples, seed))
    ]


# --- reward ---------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 32

_TRAILING_RESULT = re.compile(r"=\s*(-?[0-9]+)\s*$")
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")
_ALIASES = str.maketrans({"×": "*", "÷": "/", "−": "-"})


class ExpressionError(ValueError):
    """The answer is not a valid countdown expression (reason in the message)."""


def answer_expression(completion: str, target: int) -> str:
    """The submitted expression (``""`` when there is none)."""
    end = completion.rfind("</answer>")
    start = completion.rfind("<answer>", 0, end) if end >= 0 else -1
    if start >= 0:  # rfind, not a regex: linear even on "<answer>" * 10**5
        text = completion[start + len("<answer>") : end]
    else:
        lines = [line for line in strip_end_of_turn(completion).splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    text = text.strip()
    restated = _TRAILING_RESULT.search(text)
    if restated and int(restated.group(1)) == target:
        text = text[: restated.start()]
    return text.strip()


def _tokenize(expression: str) -> list[str]:
    tokens: list[str] = []
    position = 0
    expression = expression.translate(_ALIASES).rstrip()
    while position < len(expression):
        match = _TOKEN.match(expression, position)
        if match is None:
            raise ExpressionError(f"unexpected {expression[position : position + 10]!r} at {position}")
        tokens.append(match.group(1) or match.group(2))
        position = match.end()
    return tokens


class _Parser:
    """Recursive-descent parser + evaluator over a token list; depth bounded by ``MAX_DEPTH``."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.position = 0
        self.literals: list[int] = []

    def peek(self) -> str | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str | None:
        token = self.peek()
        self.position += 1
        return token

    def expr(self, depth: int) -> Fraction:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.term(depth)
            value = value + right if op == "+" else value - right
        return value

    def term(self, depth: int) -> Fraction:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.factor(depth)
            if op == "*":
                value *= right
            elif right == 0:
                raise ExpressionError("division by zero")
            else:
                value /= right
        return value

    def factor(self, depth: int) -> Fraction:
        if depth >= MAX_DEPTH:
            raise ExpressionError(f"nested deeper than MAX_DEPTH={MAX_DEPTH}")
        token = self.take()
        if token == "-":
            return -self.factor(depth + 1)
        if token == "(":
            value = self.expr(depth + 1)
            if self.take() != ")":
                raise ExpressionError("unbalanced parentheses")
            return value
        if token is not None and token.isdigit():
            self.literals.append(int(token))
            return Fraction(int(token))
        raise ExpressionError(f"expected a number, '(' or '-', got {token!r}")


def evaluate_expression(expression: str, numbers: list[int]) -> Fraction:
    """Exact value of ``expression`` using each of ``numbers`` at most once; ExpressionError says why not."""
    if not expression:
        raise ExpressionError("empty expression")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than MAX_EXPRESSION_CHARS={MAX_EXPRESSION_CHARS}")
    parser = _Parser(_tokenize(expression))
    value = parser.expr(0)
    if parser.peek() is not None:
        raise ExpressionError(f"unexpected {parser.peek()!r} after the expression")
    overused = Counter(parser.literals) - Counter(numbers)
    if overused:
        raise ExpressionError(f"numbers not given or used too often: {sorted(overused.elements())}")
    return value


def countdown_reward(completion: str, info: dict[str, Any]) -> float:
    """1.0 iff the submitted expression is valid and equals ``info["target"]``, else 0.0. TypeError
    when ``info`` lacks ``numbers`` ([int]) or ``target`` (int), or ``completion`` is not a str."""
    numbers = info.get("numbers") if isinstance(info, dict) else None
    target = info.get("target") if isinstance(info, dict) else None
    if not (isinstance(numbers, list) and all(isinstance(n, int) for n in numbers) and isinstance(target, int)):
        raise TypeError(f"countdown needs info={{'numbers': [int], 'target': int}}, got {info!r}")
    if not isinstance(completion, str):
        raise TypeError(f"countdown needs the completion as str, got {type(completion).__name__}")
    try:
        value = evaluate_expression(answer_expression(completion, target), numbers)
    except ExpressionError:
        return 0.0
    return 1.0 if value == target else 0.0


def make_task() -> Task:
    """The registered ``countdown`` task (no system prompt, reward ``countdown`` weight 1)."""
    return Task("countdown", countdown_examples, None, (("countdown", 1.0),))
