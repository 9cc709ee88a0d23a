"""Tests for packer.packing: FFD, BFD and MBS' packing by hand, the packer's choice
(`pack_micro_batches`) against the lower bound on many seeded random length mixes, and the
per-step micro-batch plan."""

import math
import random

import numpy as np
import pytest

from packer.packing import (
    lower_bound_bins,
    pack_best_fit_decreasing,
    pack_first_fit_decreasing,
    pack_micro_batches,
    pack_minimum_bin_slack,
    plan_step_micro_batches,
)

PACKERS = [pack_first_fit_decreasing, pack_best_fit_decreasing, pack_minimum_bin_slack, pack_micro_batches]


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


@pytest.mark.parametrize("pack", PACKERS)
def test_empty_input(pack):
    assert pack([], 8) == []
    assert lower_bound_bins([], 8) == 0
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


@pytest.mark.parametrize("pack", PACKERS)
def test_sample_over_budget_names_index(pack):
    with pytest.raises(ValueError, match=r"sample 2 has 11 tokens, more than token_budget=10"):
        pack([3, 10, 11, 12], 10)


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
@pytest.mark.parametrize("pack", PACKERS + [lower_bound_bins])
def test_bad_input_raises(lengths, budget, match, pack):
    with pytest.raises(ValueError, match=match):
        pack(lengths, budget)


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
    assert plan_step_micro_batches(lengths, 10) == [pack_micro_batches(lengths, 10)]


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


# ---- best-fit decreasing, minimum bin slack, the packer's choice -----------------------------------


def test_bfd_by_hand_differs_from_ffd():
    # lengths [7, 4, 4, 1], budget 10; visit order 7 (i0), 4 (i1), 4 (i2), 1 (i3):
    #   i0 -> new bin0, room 3 ; i1 -> no room in bin0, new bin1, room 6 ; i2 -> bin1 (only fit), room 2
    #   i3 (1 token): rooms bin0 = 3, bin1 = 2 -> FFD takes the first, bin0; BFD the tightest, bin1.
    assert pack_first_fit_decreasing([7, 4, 4, 1], 10) == [[0, 3], [1, 2]]
    assert pack_best_fit_decreasing([7, 4, 4, 1], 10) == [[0], [1, 2, 3]]


def test_bfd_ties_by_bin_creation_order():
    # budget 10, lengths [6, 6, 2]: bin0 [i0] room 4, bin1 [i1] room 4; i2 fits both with equal room -> bin0
    assert pack_best_fit_decreasing([6, 6, 2], 10) == [[0, 2], [1]]
    # and the FFD by-hand case packs the same way: 8 -> b0 (room 2), 6 -> b1 (4), 5 -> b2 (5),
    # 4 -> rooms 4 (b1), 5 (b2): tightest b1 ; 3 -> only b2 (room 5) ; 2 -> rooms 2 (b0), 2 (b2): b0
    assert pack_best_fit_decreasing([5, 3, 8, 2, 4, 6], 10) == [[2, 3], [5, 4], [0, 1]]


def test_mbs_by_hand_beats_bfd():
    # lengths [6, 5, 3, 2, 2, 2], budget 10, sum 20 -> lower bound 2.
    # BFD: 6 -> b0 (room 4) ; 5 -> b1 (5) ; 3 -> tightest b0 (1) ; 2 -> b1 (3) ; 2 -> b1 (1) ; 2 -> new b2: 3 bins.
    # MBS': bin 1 = 6 (i0) + best subset of [5, 3, 2, 2, 2] for room 4: 3 leaves 1, 2 + 2 leaves 0 -> [0, 3, 4]
    #       bin 2 = 5 (i1) + best subset of [3 (i2), 2 (i5)] for room 5: 3 + 2 leaves 0 -> [1, 2, 5]
    lengths = [6, 5, 3, 2, 2, 2]
    assert pack_best_fit_decreasing(lengths, 10) == [[0, 2], [1, 3, 4], [5]]
    assert pack_minimum_bin_slack(lengths, 10) == [[0, 3, 4], [1, 2, 5]]
    assert lower_bound_bins(lengths, 10) == 2


def test_mbs_node_limit_and_deep_search():
    # max_backtracks_per_bin=1 keeps only the greedy first descent: 6 + 3 (room 1 left), then 5 + 2 + 2, then 2
    assert pack_minimum_bin_slack([6, 5, 3, 2, 2, 2], 10, max_backtracks_per_bin=1) == [[0, 2], [1, 3, 4], [5]]
    with pytest.raises(ValueError, match="max_backtracks_per_bin must be >= 1"):
        pack_minimum_bin_slack([1], 4, max_backtracks_per_bin=0)
    # 5000 one-token samples in one 8192-token bin: a 5000-deep search, no recursion limit
    assert pack_minimum_bin_slack([1] * 5000, 8192) == [list(range(5000))]


def test_lower_bound_by_hand():
    # ceil((5 + 3 + 8 + 2 + 4 + 6) / 10) = ceil(2.8) = 3 ; ceil(20 / 10) = 2
    assert lower_bound_bins([5, 3, 8, 2, 4, 6], 10) == 3
    assert lower_bound_bins(np.array([10, 10]), 10) == 2


def random_mix(kind: str, seed: int) -> tuple[list[int], int]:
    """A seeded random length mix and token budget: the shapes a step's samples take."""
    rng = np.random.default_rng(seed)
    budget = int(rng.choice([512, 1024, 2048, 4096, 8192]))
    n = int(rng.integers(1, 513))
    if kind == "uniform":  # up to half the budget
        x = rng.integers(1, budget // 2 + 1, n)
    elif kind == "lognormal":  # long-tailed: median budget/16, a few up to the whole budget
        x = np.exp(rng.normal(np.log(budget / 16), 1.0, n))
    elif kind == "bimodal":  # half short (~budget/40), half long (~budget/5)
        x = np.where(
            rng.random(n) < 0.5, rng.normal(budget / 5, budget / 40, n), rng.normal(budget / 40, budget / 80, n)
        )
    elif kind == "tiny":  # many tiny samples
        x = rng.integers(1, 33, n)
    else:  # "capped": one prompt length p, 30% of completions truncated at the same max_tokens
        p = int(rng.integers(20, budget // 8))
        m = budget // 4 - p
        x = p + np.where(rng.random(n) < 0.3, m, rng.integers(1, m + 1, n))
    return np.clip(np.round(x), 1, budget).astype(int).tolist(), budget


@pytest.mark.parametrize("kind", ["uniform", "lognormal", "bimodal", "tiny"])
def test_micro_batches_within_lower_bound_plus_one(kind):
    for seed in range(150):
        lengths, budget = random_mix(kind, seed)
        bins = pack_micro_batches(lengths, budget)
        _check_invariants(lengths, budget, bins)
        assert len(bins) <= lower_bound_bins(lengths, budget) + 1, (kind, seed)


def test_capped_mix_needs_the_mbs_fallback():
    # The hard mix: every sample is at least the prompt long, so BFD leaves, in many bins, a gap
    # smaller than any sample; it misses lower bound + 1 on 25 of these 200 seeds (measured) and
    # MBS' takes over (0 misses on 2,000 seeds of this mix, measured). MBS' is a heuristic, not a
    # guarantee: with up to 1,024 samples it stayed at lower bound + 2 on 5 of 1,000 draws
    # (bench/README.md, "Packing quality").
    misses_bfd = 0
    for seed in range(200):
        lengths, budget = random_mix("capped", seed)
        bins = pack_micro_batches(lengths, budget)
        _check_invariants(lengths, budget, bins)
        bound = lower_bound_bins(lengths, budget)
        assert len(bins) <= bound + 1, seed
        misses_bfd += len(pack_best_fit_decreasing(lengths, budget)) > bound + 1
    assert misses_bfd >= 20  # the mix does exercise the fallback


def test_micro_batches_keep_bfd_when_it_is_within_the_bound_and_never_lose_to_it():
    for seed in range(50):
        lengths, budget = random_mix("capped", seed)
        bfd = pack_best_fit_decreasing(lengths, budget)
        chosen = pack_micro_batches(lengths, budget)
        if len(bfd) <= lower_bound_bins(lengths, budget) + 1:
            assert chosen == bfd
        assert len(chosen) <= len(bfd)


@pytest.mark.parametrize("pack", PACKERS)
def test_every_packer_is_deterministic_and_valid(pack):
    lengths, budget = random_mix("lognormal", 3)
    bins = pack(lengths, budget)
    _check_invariants(lengths, budget, bins)
    assert pack(list(reversed(lengths))[::-1], budget) == bins
    assert pack(np.array(lengths, np.int32), np.int64(budget)) == bins
