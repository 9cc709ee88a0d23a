"""reverse_text reward and the reward registry, against hand-computed difflib ratios.

ratio = 2 * M / (len(completion) + len(target)), M = characters in difflib's matching blocks
(longest common substring first, then recursively on the left and right remainders).
"""

import pytest

from rewards.registry import get_reward_fn, known_reward_names
from rewards.reverse_text import reverse_text_reward, strip_end_of_turn

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
