"""Tests for packer.packing: first-fit-decreasing packing and the per-step micro-batch plan."""

import math
import random

import numpy as np
import pytest

from packer.packing import pack_first_fit_decreasing, plan_step_micro_batches


def _check_invariants(lengths, budget, bins):
    flat = sorted(i for b in bins for i in b)
    assert flat == list(range(len(lengths))), "every index exactly once"
    assert all(sum(lengths[i] for i in b) <= budget for b in bins), "no bin over budget"
    assert all(b for b in bins), "no empty bin"


def test_ffd_by_hand():
    # lengths [5, 3, 8, 2, 4, 6], budget 10; visit order by decreasing length:
    #   8 (i2) -> new bin0 [2]           room 2
    #   6 (i5) -> bin0 full-ish, new bin1 [5]   room 4
    #   5 (i0) -> no room in 0/1, new bin2 [0]  room 5
    #   4 (i4) -> bin1 (room 4)          bin1 [5, 4] room 0
    #   3 (i1) -> bin2 (room 5)          bin2 [0, 1] room 2
    #   2 (i3) -> bin0 (room 2)          bin0 [2, 3] room 0
    lengths = [5, 3, 8, 2, 4, 6]
    bins = pack_first_fit_decreasing(lengths, 10)
    assert bins == [[2, 3], [5, 4], [0, 1]]
    # lower bound ceil(28 / 10) = 3 reached
    _check_invariants(lengths, 10, bins)


def test_ties_broken_by_index():
    # three samples of 3 into budget 6: 0 and 1 share bin0, 2 opens bin1
    assert pack_first_fit_decreasing([3, 3, 3], 6) == [[0, 1], [2]]


def test_exact_fit_and_single_sample_at_budget():
    assert pack_first_fit_decreasing([4], 4) == [[0]]
    assert pack_first_fit_decreasing([1, 1, 1, 1], 4) == [[0, 1, 2, 3]]
    assert pack_first_fit_decreasing([1, 1, 1, 1, 1], 4) == [[0, 1, 2, 3], [4]]


def test_empty_input():
    assert pack_first_fit_decreasing([], 8) == []
    assert plan_step_micro_batches([], 8, num_ranks=2) == [[], []]


def test_numpy_ints_accepted_and_deterministic():
    lengths = np.array([7, 2, 7, 5, 1], dtype=np.int32)
    # order: 7 (i0), 7 (i2), 5 (i3), 2 (i1), 1 (i4) with budget 9:
    #   i0 -> bin0 room 2 ; i2 -> bin1 room 2 ; i3 -> bin2 room 4 ; i1 -> bin0 room 0 ; i4 -> bin1 room 1
    assert pack_first_fit_decreasing(lengths, np.int64(9)) == [[0, 1], [2, 4], [3]]
    assert pack_first_fit_decreasing(lengths, 9) == pack_first_fit_decreasing(list(lengths), 9)


@pytest.mark.parametrize("seed", range(10))
def test_random_mix_near_lower_bound(seed):
    rng = random.Random(seed)
    budget = 2048
    lengths = [rng.randint(1, 1024) for _ in range(200)]
    bins = pack_first_fit_decreasing(lengths, budget)
    _check_invariants(lengths, budget, bins)
    lower_bound = math.ceil(sum(lengths) / budget)
    assert lower_bound <= len(bins) <= lower_bound + 1


def test_random_mix_with_long_samples():
    # lengths up to the budget: the sum bound is loose (samples > budget/2 each need their own
    # bin), so compare with opt_lower = max(sum bound, number of samples > budget/2).
    rng = random.Random(1234)
    budget = 4096
    lengths = [rng.randint(1, budget) for _ in range(300)]
    bins = pack_first_fit_decreasing(lengths, budget)
    _check_invariants(lengths, budget, bins)
    opt_lower = max(math.ceil(sum(lengths) / budget), sum(n > budget // 2 for n in lengths))
    # opt_lower <= OPT. For this seed: sum bound 149, samples > 2048: 151 -> opt_lower 151, FFD 153.
    # FFD <= opt_lower + 2 is much tighter than the proven 11/9 OPT + 6/9 (a regression check).
    assert len(bins) <= opt_lower + 2


def test_sample_over_budget_names_index():
    with pytest.raises(ValueError, match=r"sample 2 has 11 tokens, more than token_budget=10"):
        pack_first_fit_decreasing([3, 10, 11, 12], 10)


@pytest.mark.parametrize(
    "lengths, budget, match",
    [
        ([3, 0], 10, r"lengths\[1\] must be >= 1"),
        ([3, 2.5], 10, r"lengths\[1\] must be an int"),
        ([3], 0, "token_budget must be >= 1"),
        ([3], 10.0, "token_budget must be an int"),
        ([True], 10, r"lengths\[0\] must be an int"),
    ],
)
def test_bad_input_raises(lengths, budget, match):
    with pytest.raises(ValueError, match=match):
        pack_first_fit_decreasing(lengths, budget)


def test_plan_two_ranks_by_hand():
    # bins of test_ffd_by_hand: [2,3] (10 tokens), [5,4] (10), [0,1] (8); 2 ranks -> 2 slots each.
    #   [2,3] -> rank0 (loads 0,0; tie -> 0) ; [5,4] -> rank1 (10 vs 0) ; [0,1] -> rank0 (10 vs 10, tie)
    #   rank1 gets one padding micro-batch [].
    plan = plan_step_micro_batches([5, 3, 8, 2, 4, 6], 10, num_ranks=2)
    assert plan == [[[2, 3], [0, 1]], [[5, 4], []]]


def test_plan_more_ranks_than_bins_pads_every_rank_to_one():
    plan = plan_step_micro_batches([5, 3, 8, 2, 4, 6], 10, num_ranks=4)
    assert plan == [[[2, 3]], [[5, 4]], [[0, 1]], [[]]]


def test_plan_single_rank_is_the_packing():
    lengths = [5, 3, 8, 2, 4, 6]
    assert plan_step_micro_batches(lengths, 10) == [pack_first_fit_decreasing(lengths, 10)]


def test_plan_random_balanced_and_complete():
    rng = random.Random(7)
    lengths = [rng.randint(1, 512) for _ in range(100)]
    plan = plan_step_micro_batches(lengths, 1024, num_ranks=3)
    assert len({len(micro_batches) for micro_batches in plan}) == 1
    flat = sorted(i for micro_batches in plan for b in micro_batches for i in b)
    assert flat == list(range(100))
    loads = [sum(lengths[i] for b in mbs for i in b) for mbs in plan]
    # Unconstrained LPT spreads loads by at most one job (here <= 1024 tokens); with the equal-slots
    # constraint that is not a theorem, so this is a regression check (loads 8140, 9130, 8498).
    assert max(loads) - min(loads) <= 1024


def test_plan_bad_num_ranks():
    with pytest.raises(ValueError, match="num_ranks must be >= 1"):
        plan_step_micro_batches([1], 4, num_ranks=0)
