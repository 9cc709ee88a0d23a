"""Tests for rewards.advantages.group_advantages against hand-computed values."""

import math

import numpy as np
import pytest

from rewards.advantages import group_advantages


def test_grpo_binary_rewards_by_hand():
    # r = [1, 0, 0, 1]: mean = 0.5, deviations = [+.5, -.5, -.5, +.5],
    # population var = (4 * 0.25) / 4 = 0.25 -> std = 0.5, A = dev / (0.5 + 1e-6)
    a = group_advantages(np.array([1.0, 0.0, 0.0, 1.0]))
    expected = np.array([0.5, -0.5, -0.5, 0.5]) / 0.500001
    assert a.dtype == np.float32
    assert a.shape == (4,)
    np.testing.assert_allclose(a, expected, rtol=1e-6)


def test_grpo_uses_population_std():
    # r = [1, 2, 3, 4]: mean 2.5, dev [-1.5, -0.5, 0.5, 1.5], sum dev^2 = 2.25+0.25+0.25+2.25 = 5,
    # population var = 5/4 = 1.25, std = sqrt(1.25) = 1.1180339887 (sample std would be 1.2909944).
    a = group_advantages(np.array([1, 2, 3, 4]), eps=1e-6)
    std = math.sqrt(1.25)
    expected = np.array([-1.5, -0.5, 0.5, 1.5]) / (std + 1e-6)
    np.testing.assert_allclose(a, expected, rtol=1e-6)
    # -1.5 / 1.1180349887 = -1.3416399...
    assert a[0] == pytest.approx(-1.34164, abs=1e-5)


def test_dr_grpo_no_std_normalization():
    # r = [0.2, 1.0, 0.0]: mean = 1.2/3 = 0.4, A = [-0.2, 0.6, -0.4]
    a = group_advantages(np.array([0.2, 1.0, 0.0]), std_normalize=False)
    np.testing.assert_allclose(a, [-0.2, 0.6, -0.4], atol=1e-7)
    assert a.dtype == np.float32


def test_eps_matters_for_tiny_spread():
    # r = [0, 1e-6]: mean 5e-7, dev = [-5e-7, +5e-7], std = 5e-7,
    # A = +-5e-7 / (5e-7 + 1e-6) = +-1/3
    a = group_advantages(np.array([0.0, 1e-6]))
    np.testing.assert_allclose(a, [-1 / 3, 1 / 3], rtol=1e-5)


def test_one_sample_group_is_zero():
    a = group_advantages(np.array([0.7]))
    assert a.dtype == np.float32
    assert a.tolist() == [0.0]


@pytest.mark.parametrize("std_normalize", [True, False])
def test_equal_rewards_give_exact_zeros(std_normalize):
    # 0.1 * 3 / 3 != 0.1 in float64 (mean is off by one ulp), the function must still give 0.0 exactly.
    a = group_advantages(np.array([0.1, 0.1, 0.1]), std_normalize=std_normalize)
    assert a.tolist() == [0.0, 0.0, 0.0]


def test_input_not_modified_and_list_accepted():
    r = np.array([3.0, 1.0])
    group_advantages(r)
    assert r.tolist() == [3.0, 1.0]
    # [3, 1]: mean 2, dev [1, -1], std 1 -> A = [1, -1] / 1.000001
    np.testing.assert_allclose(group_advantages([3.0, 1.0]), [1 / 1.000001, -1 / 1.000001], rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rewards_raise(bad):
    with pytest.raises(ValueError, match=r"rewards must be finite.*index 1"):
        group_advantages(np.array([0.0, bad, 1.0]))


@pytest.mark.parametrize("shape", [(0,), (2, 2), ()])
def test_bad_shape_raises(shape):
    with pytest.raises(ValueError, match="rewards must have shape"):
        group_advantages(np.zeros(shape))


def test_non_real_dtype_raises():
    with pytest.raises(ValueError, match="rewards must be real numbers"):
        group_advantages(np.array(["a", "b"]))


@pytest.mark.parametrize("eps", [0.0, -1e-6, float("nan")])
def test_bad_eps_raises(eps):
    with pytest.raises(ValueError, match="eps must be"):
        group_advantages(np.array([0.0, 1.0]), eps=eps)
