"""The ``gsm8k`` task: grade-school math word problems, scored by their final answer's value.

Data: GSM8K (Cobbe et al. 2021, arXiv:2110.14168; MIT licence in ``tasks/data/gsm8k/LICENSE``), its
``train.jsonl``/``test.jsonl``, or the user's files (``task.dataset``). ``info = {"answer": str}``.

Reward: the completion's answer (:func:`extract_answer`) against the reference, both parsed and
compared by HuggingFace Math-Verify (sympy values, floats rounded to 6 decimals) with its
``signal.alarm`` timeouts off, so it runs in any thread (the reward worker's ``timeout_s`` bounds a
call). sympy evaluates eagerly (``9^{9^{9}}`` never returns), so a candidate that fails
:func:`is_safe_candidate` scores 0 unparsed (``\\sqrt{324}`` scores 0 against 18).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from math_verify import parse, verify

from tasks.datasets import file_task
from tasks.task import Example, Task

if TYPE_CHECKING:
    from configs.rollout import DatasetConfig

DATA_DIR = Path(__file__).resolve().parent / "data" / "gsm8k"
GSM8K_FIELDS = {"question": (str,), "answer": (str, int, float)}  # a bare numeric answer is taken as it is
GSM8K_SYSTEM_PROMPT = (
    "Solve the math problem. Reason step by step, then give the final answer as a number "
    "on the last line in the form: #### <number>"
)

# Longest candidate answer handed to sympy; GSM8K final answers have at most 9 characters.
MAX_ANSWER_CHARS = 100
# LaTeX commands a candidate may contain; anything else (\binom, \sqrt, \sum, ...) scores 0.
SAFE_LATEX_COMMANDS = frozenset({"frac", "dfrac", "tfrac", "cdot", "times", "div", "left", "right", "boxed"})
# Characters that can ask sympy for a huge computation (power, factorial, subscripts).
UNSAFE_CHARS = frozenset("^*!_")
# How far after a \boxed{ the balancing scan looks (bounds the work on many unclosed boxes).
MAX_BOXED_SCAN_CHARS = 1000

_NUM = r"[0-9]+(?:\.[0-9]+)?"
_NUMBER = re.compile(rf"(?<![0-9.])-?{_NUM}(?:/[0-9]+)?")
_FRACTION_OR_NUMBER = re.compile(rf"-?\\[dt]?frac\{{\s*{_NUM}\s*\}}\{{\s*{_NUM}\s*\}}|{_NUMBER.pattern}")
_THOUSANDS_SEPARATOR = re.compile(r"(?<=[0-9])(?:,|\{,\}|\\,)(?=[0-9]{3}(?![0-9]))")
_ANSWER_IS = re.compile(r"the (?:final )?answer is\b", re.IGNORECASE)
_TEXT_WRAPPER = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf)\s*\{([^{}]*)\}")
_LATEX_COMMAND = re.compile(r"\\([A-Za-z]+)")
_DROPPED = ("\\$", "$", "\\(", "\\)", "\\[", "\\]", "\\%", "%", "\\!", "\\,", "\\;")


def gsm8k_final_answer(solution: str) -> str:
    """The text after the last ``####`` of a worked solution, commas removed (``"#### 1,000"`` -> ``"1000"``).
    ValueError when there is no ``####``."""
    head, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    return tail.strip().replace(",", "")


def _boxed_content(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}``."""
    start = len(text)
    while (start := text.rfind("\\boxed{", 0, start)) >= 0:
        depth = 0
        begin = start + len("\\boxed{")
        for i in range(begin, min(len(text), begin + MAX_BOXED_SCAN_CHARS)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth < 0:
                return text[begin:i]
    return None


def _normalize(span: str) -> str | None:
    """A route's span -> candidate answer (:func:`extract_answer`), or None."""
    span = _THOUSANDS_SEPARATOR.sub("", span)  # before "\\," is dropped
    for token in _DROPPED:
        span = span.replace(token, "")
    span = _TEXT_WRAPPER.sub(r" \1 ", span)
    span = span.strip().rstrip(".").strip()
    if any(c in span for c in "\\^{"):  # LaTeX or a power: kept whole for is_safe_candidate
        return span
    number = _NUMBER.search(span)
    return number.group(0) if number else None


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``, normalized, or None; never raises for a str.

    First route that yields a candidate: the last ``####`` line, the last balanced ``\\boxed{}``,
    the last "the (final) answer is" line, the last number or ``\\frac{a}{b}``. ``$``, ``\\( \\)``,
    ``%``, ``\\!``, ``\\,`` and thousands separators are dropped and ``\\text{}`` unwrapped; a span
    without ``\\ ^ {`` becomes its first number (``"so #### $1,000."`` -> ``"1000"``), LaTeX is kept
    whole (``"\\boxed{\\frac{36}{2}}"`` -> ``"\\frac{36}{2}"``).
    """
    _, sep, tail = text.rpartition("####")
    if sep and (candidate := _normalize(tail.split("\n", 1)[0])):
        return candidate
    boxed = _boxed_content(text)
    if boxed is not None and (candidate := _normalize(boxed)):
        return candidate
    said = None
    for said in _ANSWER_IS.finditer(text):
        pass
    said_line = text[said.end() :].split("\n", 1)[0].lstrip(" :") if said else ""
    if said_line and (candidate := _normalize(said_line)):
        return candidate
    last = None
    for last in _FRACTION_OR_NUMBER.finditer(_THOUSANDS_SEPARATOR.sub("", text)):
        pass
    return last.group(0) if last else None


def is_safe_candidate(candidate: str) -> bool:
    """At most ``MAX_ANSWER_CHARS``, none of ``UNSAFE_CHARS``, only ``SAFE_LATEX_COMMANDS``."""
    if len(candidate) > MAX_ANSWER_CHARS or UNSAFE_CHARS.intersection(candidate):
        return False
    return all(name in SAFE_LATEX_COMMANDS for name in _LATEX_COMMAND.findall(candidate))


def _parse(candidate: str) -> list[Any]:
    # $...$ puts Math-Verify in LaTeX mode, which also reads plain numbers and \dfrac.
    return parse(f"${candidate}$", parsing_timeout=None)


@functools.lru_cache(maxsize=4096)
def _parse_reference(answer: str) -> tuple[Any, ...]:
    candidate = _normalize(answer)
    if candidate is None or not is_safe_candidate(candidate):
        raise ValueError(f"gsm8k reference answer {answer!r} is not a number or a safe LaTeX value")
    return tuple(_parse(candidate))


def gsm8k_reward(completion: str, info: dict[str, Any]) -> float:
    """1.0 iff the answer in ``completion`` equals ``info["answer"]`` (``"18"``) by value, else 0.0.
    TypeError for a non-str ``completion`` or answer; ValueError when the answer holds no number."""
    answer = info.get("answer") if isinstance(info, dict) else None
    if not isinstance(answer, str):
        raise TypeError(f"gsm8k needs info['answer'] as str, got info={info!r}")
    if not isinstance(completion, str):
        raise TypeError(f"gsm8k needs the completion as str, got {type(completion).__name__}")
    gold = _parse_reference(answer)
    candidate = extract_answer(completion)
    if not gold or candidate is None or not is_safe_candidate(candidate):
        return 0.0
    predicted = _parse(candidate)
    if not predicted:
        return 0.0
    return 1.0 if verify(list(gold), predicted, timeout_seconds=None) else 0.0


def gsm8k_example(record: dict[str, Any], example_id: str) -> Example:
    """An example from a row: ``question`` the prompt; ``answer`` a worked solution ending in ``####
    <answer>``, or the bare answer on one line. ValueError for an empty final answer."""
    answer = str(record["answer"]).strip()
    bare = "####" not in answer and "\n" not in answer
    final = gsm8k_final_answer(f"#### {answer}" if bare else answer)
    if not final:
        raise ValueError(f"empty final answer in {answer[-80:]!r}")
    return {"id": example_id, "prompt": str(record["question"]), "info": {"answer": final}}


def make_task(dataset: DatasetConfig | None = None) -> Task:
    """The registered ``gsm8k`` task (reward ``gsm8k`` weight 1); ValueError as :func:`~tasks.datasets.file_task`."""
    return file_task(
        "gsm8k",
        dataset,
        DATA_DIR,
        GSM8K_FIELDS,
        gsm8k_example,
        system_prompt=GSM8K_SYSTEM_PROMPT,
        rewards=(("gsm8k", 1.0),),
    )
