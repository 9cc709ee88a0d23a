"""Synthetic ``countdown`` problems: reach a target with some of the given numbers and + - * /.

A problem is 3 or 4 numbers (``NUM_NUMBERS``, the count drawn uniformly; 4-number draws exceed
``MAX_TARGET`` more often, so ~36% of problems have 4), each uniform in ``[MIN_NUMBER, MAX_NUMBER]``,
and a target computed from a random expression over *all* of them: the numbers are combined pairwise
in random order with random operators (``/`` only by a non-zero value, intermediate fractions
allowed) until one value is left; draws whose value is not an integer in
``[1, MAX_TARGET]`` are redrawn. So every target is reachable, and the generating expression is
kept as ``CountdownProblem.solution`` (scored 1.0 by ``rewards.countdown.countdown_reward``).

Train and eval are disjoint *by construction*, whatever their seeds, like ``reverse_text``: a
problem belongs to the eval split iff the first byte of ``sha256(canonical key)`` is below
``EVAL_BUCKET_BYTES`` (1/16 of problems), where the key is the sorted numbers and the target
(``"3,5,7->22"``), so a reordering of the same numbers cannot cross splits. Within a call the
problems are distinct.
"""

from __future__ import annotations

import hashlib
import operator
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

KNOWN_SPLITS = ("train", "eval")
NUM_NUMBERS = (3, 4)
MIN_NUMBER = 1
MAX_NUMBER = 99
MAX_TARGET = 999
# First sha256 byte of the canonical key < 16 -> eval split (1/16 of the problems).
EVAL_BUCKET_BYTES = 16
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
    first_byte = hashlib.sha256(problem.key().encode()).digest()[0]
    return "eval" if first_byte < EVAL_BUCKET_BYTES else "train"


def sample_problem(rng: random.Random) -> CountdownProblem:
    """Draw one problem from ``rng`` (see the module docstring); redraws until the target is an
    integer in ``[1, MAX_TARGET]``."""
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
    """``num_examples`` distinct problems of ``split``, deterministic in ``seed``; the first ``n``
    do not depend on ``num_examples``.

    Raises:
        ValueError: naming ``split`` or ``num_examples`` when invalid.
    """
    if split not in KNOWN_SPLITS:
        raise ValueError(f"unknown split={split!r}; known splits: {', '.join(KNOWN_SPLITS)}")
    if not isinstance(num_examples, int) or num_examples < 0:
        raise ValueError(f"num_examples must be an int >= 0, got {num_examples!r}")
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


def countdown_examples(split: str, num_examples: int, seed: int) -> list[dict[str, Any]]:
    """Task examples of ``countdown_problems(split, num_examples, seed)``.

    Returns:
        ``[{"id": "countdown/<split>/<seed>/<i>", "prompt": str, "info": {"numbers": [int],
        "target": int}}]``; the prompt states the numbers, the target, the rules and the
        ``<answer></answer>`` format that ``rewards.countdown`` reads.

    Raises:
        ValueError: naming ``split`` or ``num_examples`` when invalid.
    """
    return [
        {
            "id": f"countdown/{split}/{seed}/{i}",
            "prompt": PROMPT_TEMPLATE.format(
                numbers=", ".join(map(str, problem.numbers)), target=problem.target
            ),
            "info": {"numbers": list(problem.numbers), "target": problem.target},
        }
        for i, problem in enumerate(countdown_problems(split, num_examples, seed))
    ]
