"""reverse_text reward (against hand-computed difflib ratios) and the reward registry.

ratio = 2 * M / (len(completion) + len(target)), M = characters in difflib's matching blocks
(longest common substring first, then recursively on the left and right remainders).
"""

import subprocess
import sys
from pathlib import Path

import pytest

from tasks.reverse_text import reverse_text_reward
from tasks.rewards import get_reward_fn, known_reward_names, reward_name
from tasks.task import strip_end_of_turn

INFO = {"target": "olleh"}  # the prompt was "hello"


def test_perfect_answer_scores_one():
    assert reverse_text_reward("olleh", INFO) == 1.0


def test_trailing_end_of_turn_and_whitespace_are_ignored():
    assert reverse_text_reward("olleh<|im_end|>", INFO) == 1.0
    assert reverse_text_reward("  olleh \n<|im_end|>\n", INFO) == 1.0
    assert reverse_text_reward("olleh<|endoftext|>", INFO) == 1.0
    assert strip_end_of_turn("ab<|im_end|><|endoftext|> ") == "ab"


def test_empty_completion_scores_zero():
    # M = 0 -> 2 * 0 / (0 + 5) = 0
    assert reverse_text_reward("", INFO) == 0.0
    assert reverse_text_reward("<|im_end|>", INFO) == 0.0


def test_truncated_answer():
    # "olle" vs "olleh": one block "olle" (M = 4) -> 2 * 4 / (4 + 5) = 8/9
    assert reverse_text_reward("olle", INFO) == pytest.approx(8 / 9)


def test_one_wrong_character():
    # "olxeh" vs "olleh": blocks "ol" and "eh" (M = 4) -> 2 * 4 / (5 + 5) = 0.8
    assert reverse_text_reward("olxeh", INFO) == pytest.approx(0.8)


def test_unreversed_copy_gets_partial_credit():
    # "hello" vs "olleh": longest block "ll" (M = 2); left "he" vs "o" and right "o" vs "eh"
    # share nothing -> 2 * 2 / (5 + 5) = 0.4
    assert reverse_text_reward("hello", INFO) == pytest.approx(0.4)


def test_disjoint_letters_score_zero():
    assert reverse_text_reward("xyz", INFO) == 0.0


def test_missing_target_is_a_type_error():
    with pytest.raises(TypeError, match="target"):
        reverse_text_reward("olleh", {})


def test_registry_returns_reverse_text():
    assert "reverse_text" in known_reward_names()
    fn = get_reward_fn("reverse_text")
    assert fn("olleh", INFO) == 1.0


def test_registry_unknown_name_lists_known():
    with pytest.raises(ValueError, match="reverse_text"):
        get_reward_fn("nope")


def test_registry_knows_every_shipped_task():
    assert {"reverse_text", "gsm8k", "countdown"} <= set(known_reward_names())
    assert get_reward_fn("gsm8k")("The answer is 18.", {"answer": "18"}) == 1.0


def test_reward_names_for_terms_and_logs():
    assert reward_name("gsm8k") == "gsm8k"
    assert reward_name("my_pkg.scoring:brevity") == "brevity"
    assert reward_name("my_pkg.scoring:Judge.score") == "score"
    with pytest.raises(ValueError, match="reverse_text"):
        reward_name("nope")
    with pytest.raises(ValueError, match="package.module:function"):
        reward_name("my_pkg:")


def test_registry_imports_verifiers_only_when_asked():
    # a reward child that runs only reverse_text must not pay math-verify's import (~0.25 s)
    code = (
        "import sys; from tasks.rewards import get_reward_fn; get_reward_fn('reverse_text'); "
        "assert 'math_verify' not in sys.modules; get_reward_fn('gsm8k'); assert 'math_verify' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
