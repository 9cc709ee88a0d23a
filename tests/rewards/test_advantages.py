"""Tests for rewards.advantages: every estimator against values computed by hand, the edge cases
(one-sample groups, all-equal rewards, zero-length completions), custom import paths, and the
reward worker's wiring (completion lengths taken from the group message)."""

import math

import numpy as np
import pytest
from pydantic import ValidationError

from bus.messages import RolloutGroup
from configs.schema import RewardsConfig
from rewards.advantages import ADVANTAGE_NAMES, compute_advantages, resolve_advantage_fn
from rewards.worker import RewardWorker

EPS = 1e-6


def adv(name, rewards, lengths=None, eps=EPS):
    lengths = np.ones(len(rewards), np.int64) if lengths is None else np.asarray(lengths)
    return compute_advantages(name, np.asarray(rewards), lengths, eps)


# ---- custom estimators, referenced by import path f"{__name__}:..." ------------------------------


def reward_times_length(rewards, completion_lengths):
    """A_i = r_i * L_i; records the dtypes it was called with."""
    reward_times_length.seen = (rewards.dtype, completion_lengths.dtype)
    return rewards * completion_lengths


def scribbles_on_inputs(rewards, completion_lengths):
    rewards[:] = 99.0
    completion_lengths[:] = 99
    return np.zeros(rewards.shape)


def returns_nan(rewards, completion_lengths):
    return np.full(rewards.shape, np.nan)


def returns_huge(rewards, completion_lengths):
    return np.full(rewards.shape, 1e39)  # finite in float64, inf in float32


def returns_wrong_shape(rewards, completion_lengths):
    return np.zeros(rewards.size + 1)


def returns_text(rewards, completion_lengths):
    return ["a"] * rewards.size


NOT_CALLABLE = 3


# ---- grpo ------------------------------------------------------------------------------------------


def test_grpo_binary_rewards_by_hand():
    # r = [1, 0, 0, 1]: mean = 0.5, deviations = [+.5, -.5, -.5, +.5],
    # population var = (4 * 0.25) / 4 = 0.25 -> std = 0.5, A = dev / (0.5 + 1e-6)
    a = adv("grpo", [1.0, 0.0, 0.0, 1.0])
    assert a.dtype == np.float32 and a.shape == (4,)
    np.testing.assert_allclose(a, np.array([0.5, -0.5, -0.5, 0.5]) / 0.500001, rtol=1e-6)


def test_grpo_uses_population_std():
    # r = [1, 2, 3, 4]: mean 2.5, dev [-1.5, -0.5, 0.5, 1.5], sum dev^2 = 2.25+0.25+0.25+2.25 = 5,
    # population var = 5/4 = 1.25, std = sqrt(1.25) = 1.1180339887 (sample std would be 1.2909944).
    a = adv("grpo", np.array([1, 2, 3, 4]))
    std = math.sqrt(1.25)
    np.testing.assert_allclose(a, np.array([-1.5, -0.5, 0.5, 1.5]) / (std + 1e-6), rtol=1e-6)
    assert a[0] == pytest.approx(-1.34164, abs=1e-5)  # -1.5 / 1.1180349887


def test_grpo_eps_matters_for_tiny_spread():
    # r = [0, 1e-6]: mean 5e-7, dev = [-5e-7, +5e-7], std = 5e-7, A = +-5e-7 / (5e-7 + 1e-6) = +-1/3
    np.testing.assert_allclose(adv("grpo", [0.0, 1e-6]), [-1 / 3, 1 / 3], rtol=1e-5)


# ---- drgrpo ----------------------------------------------------------------------------------------


def test_drgrpo_is_mean_centred_only():
    # r = [0.2, 1.0, 0.0]: mean = 1.2/3 = 0.4, A = [0.2-0.4, 1.0-0.4, 0.0-0.4] = [-0.2, 0.6, -0.4]
    a = adv("drgrpo", [0.2, 1.0, 0.0])
    np.testing.assert_allclose(a, [-0.2, 0.6, -0.4], atol=1e-7)
    assert a.dtype == np.float32


# ---- rloo ------------------------------------------------------------------------------------------


def test_rloo_by_hand():
    # r = [0.2, 1.0, 0.0], G = 3, S = 1.2; baseline_i = (S - r_i) / 2:
    #   A_0 = 0.2 - (1.0 + 0.0)/2 = -0.3
    #   A_1 = 1.0 - (0.2 + 0.0)/2 =  0.9
    #   A_2 = 0.0 - (0.2 + 1.0)/2 = -0.6
    # (= G/(G-1) * drgrpo = 1.5 * [-0.2, 0.6, -0.4])
    np.testing.assert_allclose(adv("rloo", [0.2, 1.0, 0.0]), [-0.3, 0.9, -0.6], atol=1e-7)


def test_rloo_binary_and_two_samples_by_hand():
    # r = [1, 0, 0, 1]: A_0 = 1 - (0+0+1)/3 = 2/3, A_1 = 0 - (1+0+1)/3 = -2/3
    np.testing.assert_allclose(adv("rloo", [1.0, 0.0, 0.0, 1.0]), [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6)
    # G = 2, r = [3, 1]: A_0 = 3 - 1 = 2, A_1 = 1 - 3 = -2
    np.testing.assert_allclose(adv("rloo", [3.0, 1.0]), [2.0, -2.0], atol=0)


# ---- length_weighted -------------------------------------------------------------------------------


def test_length_weighted_by_hand():
    # r = [1, 0, 0.5], L = [2, 6, 4]: sum L = 12, sum L*r = 2 + 0 + 2 = 4, baseline = 4/12 = 1/3
    # A = [1 - 1/3, 0 - 1/3, 0.5 - 1/3] = [2/3, -1/3, 1/6]; token-level sum L*A = 4/3 - 2 + 2/3 = 0
    a = adv("length_weighted", [1.0, 0.0, 0.5], [2, 6, 4])
    np.testing.assert_allclose(a, [2 / 3, -1 / 3, 1 / 6], rtol=1e-6)
    assert abs(float(np.dot([2, 6, 4], a.astype(np.float64)))) < 1e-6


def test_length_weighted_zero_length_completion_weighs_nothing():
    # r = [1, 0, 0.5], L = [0, 6, 4]: sum L = 10, sum L*r = 0 + 0 + 2 = 2, baseline = 0.2
    # A = [0.8, -0.2, 0.3]: the empty completion still gets r_i - baseline (it has no token to train)
    np.testing.assert_allclose(adv("length_weighted", [1.0, 0.0, 0.5], [0, 6, 4]), [0.8, -0.2, 0.3], atol=1e-7)


def test_length_weighted_all_lengths_zero_falls_back_to_mean():
    # L = [0, 0, 0]: weights 0/0 undefined -> plain mean 0.5, A = [0.5, -0.5, 0.0]
    np.testing.assert_allclose(adv("length_weighted", [1.0, 0.0, 0.5], [0, 0, 0]), [0.5, -0.5, 0.0], atol=0)


def test_length_weighted_equal_lengths_is_drgrpo():
    # L_j all equal to c: baseline = c * sum r / (G * c) = mean(r)
    r = [0.2, 1.0, 0.0]
    np.testing.assert_allclose(adv("length_weighted", r, [7, 7, 7]), adv("drgrpo", r), atol=1e-7)


# ---- edge cases shared by every built-in estimator -------------------------------------------------


@pytest.mark.parametrize("name", ADVANTAGE_NAMES)
def test_one_sample_group_is_zero(name):
    for lengths in ([5], [0]):
        a = adv(name, [0.7], lengths)
        assert a.dtype == np.float32 and a.tolist() == [0.0]


@pytest.mark.parametrize("name", ADVANTAGE_NAMES)
def test_equal_rewards_give_exact_zeros(name):
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004 in float64, so the mean (and the leave-one-out and
    # length-weighted means) are off by an ulp; the estimator must still give exactly 0.0.
    for lengths in ([1, 2, 3], [0, 0, 0], [0, 4, 9]):
        assert adv(name, [0.1, 0.1, 0.1], lengths).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ADVANTAGE_NAMES)
def test_zero_length_completions_do_not_crash(name):
    a = adv(name, [1.0, 0.0, 0.0, 1.0], [0, 0, 3, 5])
    assert a.shape == (4,) and np.isfinite(a).all()
    assert a[0] > 0 > a[1]


@pytest.mark.parametrize("name", ADVANTAGE_NAMES)
def test_inputs_not_modified_and_lists_accepted(name):
    r = np.array([3.0, 1.0])
    lengths = np.array([2, 0], np.int32)
    compute_advantages(name, r, lengths)
    assert r.tolist() == [3.0, 1.0] and lengths.tolist() == [2, 0]
    assert compute_advantages(name, [3.0, 1.0], [2, 0]).tolist() == compute_advantages(name, r, lengths).tolist()


# ---- custom estimators -----------------------------------------------------------------------------


def test_custom_import_path_by_hand():
    # A_i = r_i * L_i: r = [1, 0, 0.5], L = [2, 6, 4] -> [2, 0, 2]; called with float64 / int64
    fn = resolve_advantage_fn(f"{__name__}:reward_times_length")
    assert fn is reward_times_length
    a = compute_advantages(fn, np.array([1.0, 0.0, 0.5], np.float32), np.array([2, 6, 4], np.int32))
    assert a.dtype == np.float32 and a.tolist() == [2.0, 0.0, 2.0]
    assert reward_times_length.seen == (np.float64, np.int64)
    # the same through the path string (imported on the call)
    assert adv(f"{__name__}:reward_times_length", [1.0, 0.0, 0.5], [2, 6, 4]).tolist() == [2.0, 0.0, 2.0]


def test_custom_function_is_called_even_for_equal_rewards():
    # all-equal rewards: custom estimators may shape on purpose; r = [1, 1], L = [3, 0] -> [3, 0]
    assert compute_advantages(reward_times_length, [1.0, 1.0], [3, 0]).tolist() == [3.0, 0.0]


def test_custom_function_gets_copies():
    r, lengths = np.array([1.0, 2.0]), np.array([3, 4])
    compute_advantages(scribbles_on_inputs, r, lengths)
    assert r.tolist() == [1.0, 2.0] and lengths.tolist() == [3, 4]


@pytest.mark.parametrize(
    "fn, match",
    [
        (returns_nan, "returns_nan returned a non-finite value at index 0"),
        (returns_huge, "returns_huge returned a non-finite value.*float32"),
        (returns_wrong_shape, r"returns_wrong_shape must return shape \[group_size\]=\(2,\), got \(3,\)"),
        (returns_text, "returns_text must return real numbers"),
    ],
)
def test_custom_output_validated(fn, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(fn, [1.0, 0.0], [1, 1])


@pytest.mark.parametrize(
    "path, match",
    [
        ("no_such_module_xyz:fn", r"advantage import path='no_such_module_xyz:fn': cannot import 'no_such_module_xyz'"),
        (f"{__name__}:missing", "has no attribute 'missing'"),
        (f"{__name__}:NOT_CALLABLE", "names a int, not a function"),
        (":fn", "must look like 'package.module:function'"),
        ("gpro", "unknown advantage estimator 'gpro'; use one of grpo, drgrpo, rloo, length_weighted"),
    ],
)
def test_bad_reference_raises_naming_it(path, match):
    with pytest.raises(ValueError, match=match):
        resolve_advantage_fn(path)
    with pytest.raises(ValueError, match=match):
        compute_advantages(path, [1.0, 0.0], [1, 1])


# ---- input validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rewards_raise(bad):
    with pytest.raises(ValueError, match=r"rewards must be finite.*index 1"):
        adv("grpo", np.array([0.0, bad, 1.0]))


@pytest.mark.parametrize("shape", [(0,), (2, 2), ()])
def test_bad_reward_shape_raises(shape):
    with pytest.raises(ValueError, match="rewards must have shape"):
        compute_advantages("grpo", np.zeros(shape), np.zeros(1, np.int64))


def test_non_real_rewards_raise():
    with pytest.raises(ValueError, match="rewards must be real numbers"):
        adv("grpo", np.array(["a", "b"]))


@pytest.mark.parametrize(
    "lengths, match",
    [
        ([1.0, 2.0], "completion_lengths must be integers"),
        ([True, False], "completion_lengths must be integers"),
        ([1, 2, 3], r"completion_lengths must have shape \[group_size\]=\(2,\)"),
        ([1, -1], "completion_lengths must be >= 0, got -1 at index 1"),
    ],
)
def test_bad_lengths_raise(lengths, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages("length_weighted", [1.0, 0.0], np.asarray(lengths))


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan"), True])
def test_bad_eps_raises(eps):
    with pytest.raises(ValueError, match="eps must be"):
        adv("grpo", [0.0, 1.0], eps=eps)


# ---- config and worker wiring ----------------------------------------------------------------------


def test_config_accepts_every_builtin_and_import_paths_only():
    for name in ADVANTAGE_NAMES:
        assert RewardsConfig(advantage=name).advantage == name
    assert RewardsConfig().advantage == "grpo"
    assert RewardsConfig(advantage="pkg.mod:fn").advantage == "pkg.mod:fn"  # imported at worker start
    with pytest.raises(ValidationError, match=f"use one of {', '.join(ADVANTAGE_NAMES)} or an import path"):
        RewardsConfig(advantage="reinforce")


def scored_by(advantage: str, texts: list[str], lens: list[int]):
    """Score a reverse-text group (target 'olleh') whose completions have token counts `lens`."""
    g, n = len(texts), sum(lens)
    group = RolloutGroup(
        id="grp-adv",
        prompt_index=0,
        step=0,
        task="reverse_text",
        info={"target": "olleh"},
        producer="p0",
        completion_texts=texts,
        finish_reasons=["stop"] * g,
        gen_time_s=0.1,
        prompt_ids=np.arange(3, dtype=np.int32),
        completion_ids=np.arange(n, dtype=np.int32),
        completion_lens=np.array(lens, np.int32),
        sampler_logprobs=np.zeros(n, np.float32),
        version_start=np.zeros(g, np.int64),
        version_end=np.zeros(g, np.int64),
    )
    return RewardWorker(
        {"reverse_text": (("reverse_text", 1.0),)}, advantage=advantage, name="rw", isolate=False
    ).score(group)


def test_worker_uses_completion_lengths_of_the_group():
    # reverse_text rewards: "olleh" -> 1.0, "oll" -> 2*3/(3+5) = 0.75, "" -> 0.0 (a zero-length completion)
    # L = [5, 3, 0]: sum L = 8, sum L*r = 5 + 2.25 + 0 = 7.25, baseline = 0.90625
    # A = [1 - 0.90625, 0.75 - 0.90625, 0 - 0.90625] = [0.09375, -0.15625, -0.90625]
    scored = scored_by("length_weighted", ["olleh", "oll", ""], [5, 3, 0])
    assert scored.rewards.tolist() == [1.0, 0.75, 0.0]
    np.testing.assert_allclose(scored.advantages, [0.09375, -0.15625, -0.90625], atol=1e-7)
    # rloo on the same rewards: A_0 = 1 - 0.75/2 = 0.625, A_1 = 0.75 - 1/2 = 0.25, A_2 = 0 - 1.75/2 = -0.875
    np.testing.assert_allclose(
        scored_by("rloo", ["olleh", "oll", ""], [5, 3, 0]).advantages, [0.625, 0.25, -0.875], atol=1e-7
    )
    # custom by import path: r * L = [5, 2.25, 0]
    custom = scored_by(f"{__name__}:reward_times_length", ["olleh", "oll", ""], [5, 3, 0])
    assert custom.advantages.dtype == np.float32 and custom.advantages.tolist() == [5.0, 2.25, 0.0]


def test_worker_rejects_a_bad_advantage_at_start():
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        RewardWorker(
            {"reverse_text": (("reverse_text", 1.0),)}, advantage="no_such_module_xyz:fn", name="rw", isolate=True
        )
