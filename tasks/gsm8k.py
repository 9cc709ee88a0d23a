"""The ``gsm8k`` task: grade-school math word problems, scored by their final answer's value.

Dataset: GSM8K (Cobbe et al., 2021, arXiv:2110.14168) from ``tasks/data/gsm8k/`` (MIT licence in
its ``LICENSE``; train: ``train.jsonl``, eval: ``test.jsonl``), or the user's local JSONL/Parquet
files (``task.dataset``, :func:`tasks.datasets.file_task`: split order and ids). Prompt =
``question`` after the system prompt ``GSM8K_SYSTEM_PROMPT``; ``info = {"answer": the text after
"####" of the worked ``answer``}`` (:func:`gsm8k_example`; a user's ``answer`` may also be the bare
final answer on one line).

Reward (:func:`gsm8k_reward`): 1.0 iff the completion's final answer equals the reference by
value. GSM8K worked solutions end with a line ``#### <answer>``; the reference ``info["answer"]``
is that text (``gsm8k_final_answer``), e.g. ``"18"`` or ``"1,000"``.

Extraction (``extract_answer``) takes the first route that yields a candidate, in this order:

1. the text after the last ``####``, up to the end of its line;
2. the content of the last ``\\boxed{...}`` with balanced braces;
3. the text after the last "the answer is" / "the final answer is" (any case), up to the end of
   its line;
4. the last number (or ``\\frac{a}{b}`` of two numbers) anywhere in the text.

A span is then normalized: ``$``/``\\$`` (currency or inline math), ``\\( \\) \\[ \\]``, ``%``/``\\%``
(GSM8K answers are the bare number: "50%" -> ``#### 50``), ``\\!``, ``\\,`` and thousands separators
(``1,000``, ``1{,}000``, ``1\\,000``) are dropped and ``\\text{..}``-like wrappers unwrapped. A span
with no ``\\``, ``^`` or ``{`` left becomes its first number (``[0-9]`` only; optional ``-``,
decimals, ``a/b``): "18 dollars." -> ``"18"``, "**18**" -> ``"18"``; any other span (LaTeX such as
``\\frac{36}{2}``, a power) is kept whole. A route whose span yields nothing (``#### `` followed
by prose) passes to the next route.

Comparison (``gsm8k_reward``): both sides go through ``math_verify.parse`` and ``math_verify.verify``
(HuggingFace Math-Verify: sympy values, floats compared after rounding to 6 decimals), so ``18``,
``18.0``, ``$18``, ``\\frac{36}{2}`` and ``\\boxed{18}`` all equal ``"18"``. Math-Verify's own
timeouts use ``signal.alarm`` (main thread only), so they are off here (``parsing_timeout=None``,
``timeout_seconds=None``) and this function runs in any thread; the reward worker's per-call
``timeout_s`` bounds it (``rewards.scorers``). Because sympy evaluates eagerly (``9^{9^{9}}``
never returns), a candidate longer than ``MAX_ANSWER_CHARS``, with ``^``, ``*``, ``!``, ``_`` or
a LaTeX command outside ``SAFE_LATEX_COMMANDS`` scores 0 without being parsed (so ``\\sqrt{324}``
scores 0 against 18: GSM8K answers are plain numbers). Math-Verify logs one warning per process
that its timeout is disabled.
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
    """The final answer of a GSM8K worked solution: the text after its last ``####``, stripped,
    commas removed (``"...\\n#### 1,000"`` -> ``"1000"``).

    Raises:
        ValueError: when ``solution`` has no ``####`` line (not a GSM8K solution).
    """
    head, sep, tail = solution.rpartition("####")
    if not sep:
        raise ValueError(f"GSM8K solution has no '#### <answer>' line: {solution[-80:]!r}")
    return tail.strip().replace(",", "")


def _boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` whose braces balance (within ``MAX_BOXED_SCAN_CHARS``)."""
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
    """A route's span -> candidate answer (see the module docstring), or None when it has none."""
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
    """The final answer written in ``text`` (a model completion), normalized, or None.

    Routes, in order: ``#### x``, last ``\\boxed{x}``, "the answer is x", last number; see the
    module docstring for the normalization. Examples: ``"so #### $1,000."`` -> ``"1000"``,
    ``"\\boxed{\\frac{36}{2}}"`` -> ``"\\frac{36}{2}"``, ``"The answer is -3.5 kg"`` -> ``"-3.5"``,
    ``"3 + 4 = 7 apples"`` -> ``"7"``, ``"no digits"`` -> None. Never raises for a str.
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
    """True when ``candidate`` may be handed to sympy: short, no power/factorial/subscript, and
    only LaTeX commands from ``SAFE_LATEX_COMMANDS`` (bounds the cost of parsing; see module doc)."""
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
    """1.0 iff the answer extracted from ``completion`` equals ``info["answer"]`` by value, else 0.0.

    Args:
        completion: the model's text; anything (empty, garbage, huge) scores 0.0 without raising.
        info: ``{"answer": str}``, the reference final answer (``"18"``, ``"1,000"``, ``"-2.5"``).

    Raises:
        TypeError: when ``completion`` is not a str or ``info["answer"]`` is missing or not a str.
        ValueError: when ``info["answer"]`` holds no number (a broken dataset row).
    """
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
    """One example from a row: ``question`` is the prompt; ``answer`` is a worked solution ending in
    ``#### <final answer>`` (GSM8K's own format) or, for a user's dataset, the final answer alone on
    one line.

    Raises:
        ValueError: the final answer is empty.
    """
    answer = str(record["answer"]).strip()
    bare = "####" not in answer and "\n" not in answer
    final = gsm8k_final_answer(f"#### {answer}" if bare else answer)
    if not final:
        raise ValueError(f"empty final answer in {answer[-80:]!r}")
    return {"id": example_id, "prompt": str(record["question"]), "info": {"answer": final}}


def make_task(dataset: DatasetConfig | None = None) -> Task:
    """The registered ``gsm8k`` task over ``DATA_DIR`` or the user's ``dataset`` files
    (system prompt ``GSM8K_SYSTEM_PROMPT``, reward ``gsm8k`` weight 1).

    Raises:
        ValueError: see :func:`tasks.datasets.file_task`.
    """
    return file_task(
        "gsm8k",
        dataset,
        DATA_DIR,
        ("question", "answer"),
        gsm8k_example,
        system_prompt=GSM8K_SYSTEM_PROMPT,
        rewards=(("gsm8k", 1.0),),
    )
