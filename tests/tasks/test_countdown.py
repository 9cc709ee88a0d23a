"""countdown reward: valid expressions, wrong values, number usage, answer format, malformed and
hostile input (each must score 0.0 quickly and never raise)."""

from __future__ import annotations

import time

import pytest

from tasks.countdown import (
    MAX_DEPTH,
    MAX_EXPRESSION_CHARS,
    ExpressionError,
    answer_expression,
    countdown_reward,
    evaluate_expression,
)

INFO = {"numbers": [3, 5, 7, 7], "target": 22}


@pytest.mark.parametrize(
    "completion",
    [
        "<answer>3*5+7</answer>",
        "<answer> (3 * 5) + 7 </answer>",
        "<answer>7 + 5 * 3</answer>",
        "<answer>3 × 5 + 7</answer>",  # × and ÷ read as * and /
        "<answer>-(-(3*5))+7</answer>",
        "<answer>7 + 7 + 5 + 3</answer>",  # 7 is given twice, so it may be used twice
        "I think so.\n<answer>3*5+7</answer>\n<|im_end|>",
        "<answer>1+1</answer> wait, better: <answer>3*5+7</answer>",  # the LAST tag counts
        "Let me compute.\n(3*5)+7 = 22",  # no tag: last non-empty line; "= 22" stripped
        "3*5+7\n\n<|im_end|>",
        "<answer>3*5+7=22</answer>",
    ],
)
def test_valid_expressions_score_one(completion):
    assert countdown_reward(completion, INFO) == 1.0


def test_exact_fraction_arithmetic():
    info = {"numbers": [1, 3, 4, 6], "target": 24}
    assert countdown_reward("<answer>6 / (1 - 3/4)</answer>", info) == 1.0  # float-free: 6 / (1/4)
    assert evaluate_expression("1/3 + 1/3 + 1/3", [1, 1, 1, 3, 3, 3]) == 1


@pytest.mark.parametrize(
    "completion, why",
    [
        ("<answer>3*5+5</answer>", "5 given once, used twice"),
        ("<answer>3*5+7+7+7</answer>", "7 given twice, used three times"),
        ("<answer>15+7</answer>", "15 not given"),
        ("<answer>2*11</answer>", "neither given"),
        ("<answer>3*5+8-1</answer>", "8 and 1 not given"),
        ("<answer>3+5+7</answer>", "valid but 15"),
        ("<answer>3*5+7</answer> no wait <answer>3+5</answer>", "last tag is 8"),
        ("3*5+7\nso that is it", "last line is prose"),
        ("<answer>3*5+7 = 23</answer>", "only '= target' is stripped"),
        ("<answer>(3*5)+7/0</answer>", "division by zero"),
        ("<answer>7/(5-5)</answer>", "division by zero"),
    ],
)
def test_wrong_value_or_numbers_score_zero(completion, why):
    assert countdown_reward(completion, INFO) == 0.0, why


@pytest.mark.parametrize(
    "completion",
    [
        "",
        "   \n\n",
        "<answer></answer>",
        "<answer>   </answer>",
        "<answer>(3*5+7</answer>",
        "<answer>3*5+7)</answer>",
        "<answer>()</answer>",
        "<answer>3*/5+7</answer>",
        "<answer>3 5 7</answer>",
        "<answer>+3*5+7</answer>",
        "<answer>3*5+7.0</answer>",
        "<answer>3*5+7 = 22 = 22</answer>",
        "twenty two",
        "<answer>3*5+7",
        "<answer>3*5+7<answer>",
    ],
)
def test_malformed_scores_zero(completion):
    assert countdown_reward(completion, INFO) == 0.0


HOSTILE = [
    "<answer>9**9**9**9</answer>",
    "9**9**9**9",
    "<answer>2**100000</answer>",
    "<answer>3^5</answer>",
    "<answer>" + "(" * 10_000 + "3" + ")" * 10_000 + "</answer>",
    "<answer>" + "(" * 10_000 + "</answer>",
    "(" * 100_000,
    "<answer>" + "-" * 10_000 + "3</answer>",
    "<answer>__import__('os').system('x')</answer>",
    "__import__('os').system('touch /tmp/pwned')",
    "<answer>().__class__</answer>",
    "<answer>(3).__class__</answer>",
    "<answer>x + 3</answer>",
    "<answer>abs(-22)</answer>",
    "<answer>(lambda: 22)()</answer>",
    "<answer>f'{3*5+7}'</answer>",
    "<answer>[3][0]*5+7</answer>",
    "<answer>3*5+7 if True else 0</answer>",
    "<answer>3*5+7; import os</answer>",
    "<answer>\u0663*\u0665+\u0667</answer>",  # Arabic-Indic digits 3, 5, 7
    "<answer>３*５+７</answer>",  # full-width digits
    "<answer>" + "3+" * 100_000 + "7</answer>",
    "<answer>" + "1" * 100_000 + "</answer>",
    "<answer>" * 100_000,
    "</answer>" * 100_000,
    "<answer>" * 50_000 + "</answer>" * 50_000,
    "\x00\udcff<answer>\x00</answer>",
]


@pytest.mark.parametrize("completion", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_input_scores_zero_quickly(completion):
    started = time.perf_counter()
    assert countdown_reward(completion, INFO) == 0.0
    assert time.perf_counter() - started < 0.5


def test_limits_are_enforced_with_a_reason():
    with pytest.raises(ExpressionError, match="MAX_EXPRESSION_CHARS"):
        evaluate_expression("3+" * MAX_EXPRESSION_CHARS + "3", [3])
    with pytest.raises(ExpressionError, match="MAX_DEPTH"):
        evaluate_expression("(" * MAX_DEPTH + "3" + ")" * MAX_DEPTH, [3])
    assert evaluate_expression("(" * (MAX_DEPTH - 1) + "3" + ")" * (MAX_DEPTH - 1), [3]) == 3


def test_answer_expression_format():
    assert answer_expression("x <answer>1+2</answer> y <answer> 3*4 = 12 </answer> z", 12) == "3*4"
    assert answer_expression("<answer>3*4 = 13</answer>", 12) == "3*4 = 13"
    assert answer_expression("work\n\n  (1 + 2) * 3 = 9  \n\n", 9) == "(1 + 2) * 3"
    assert answer_expression("<answer>a<answer>b</answer>", 9) == "b"
    assert answer_expression("", 9) == ""


def test_bad_info_is_a_type_error():
    for info in ({}, {"numbers": [3], "target": "22"}, {"numbers": (3,), "target": 22}, None):
        with pytest.raises(TypeError, match="numbers"):
            countdown_reward("3", info)
    with pytest.raises(TypeError, match="completion"):
        countdown_reward(None, INFO)
