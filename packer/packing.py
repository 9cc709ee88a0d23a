"""Padding-free packing of samples into micro-batches (bin packing): a micro-batch is one row of at
most ``token_budget`` tokens of whole samples. The packer uses :func:`pack_micro_batches`: best-fit
decreasing (BFD, Johnson 1973), and minimum bin slack (MBS': Gupta & Ho 1999, Production Planning &
Control 10(6); Fleszar & Hindi 2002, Computers & Operations Research 29(7)) where BFD needs more than
``lower_bound_bins + 1`` bins (bench/README.md). First-fit decreasing (FFD(I) <= 11/9 OPT(I) + 6/9,
Dosa 2007) is kept for comparison. Every function puts each sample into exactly one non-empty bin
within the budget and depends on its inputs only (ties by index; MBS' bounded by dead ends, not time).
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Sequence

__all__ = [
    "lower_bound_bins",
    "pack_best_fit_decreasing",
    "pack_first_fit_decreasing",
    "pack_micro_batches",
    "pack_minimum_bin_slack",
    "plan_step_micro_batches",
]

MBS_MAX_BACKTRACKS_PER_BIN = 2000
"""Most dead ends MBS' backs out of per bin (bounds its time: about 1 ms per bin in CPython)."""


def lower_bound_bins(lengths: Sequence[int], token_budget: int) -> int:
    """``ceil(sum(lengths) / token_budget)``, bound L1 of Martello & Toth 1990 ("Knapsack Problems",
    sec. 8.3): no packing uses fewer bins. ValueError as :func:`pack_first_fit_decreasing`."""
    budget = _validated_budget(token_budget)
    return math.ceil(sum(_validated_lengths(lengths, budget)) / budget)


def pack_first_fit_decreasing(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing: samples (``lengths``, ints >= 1) by decreasing length (ties by index), each
    into the first open bin of ``token_budget`` with room, else a new bin. Returns the bins in creation
    order as sample indices (``[]`` for none). ValueError for a budget or length not an int >= 1, or a
    sample over the budget (named by index)."""
    budget = _validated_budget(token_budget)
    sizes = _validated_lengths(lengths, budget)
    bins: list[list[int]] = []
    room: list[int] = []
    for index in _decreasing_order(sizes):
        size = sizes[index]
        slot = next((b for b, free in enumerate(room) if free >= size), len(bins))
        if slot == len(bins):
            bins.append([])
            room.append(budget)
        bins[slot].append(index)
        room[slot] -= size
    assert all(free >= 0 for free in room)
    return bins


def pack_best_fit_decreasing(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Best-fit decreasing: as :func:`pack_first_fit_decreasing`, into the open bin with the least room
    that fits (ties: the oldest bin); one binary search per sample."""
    budget = _validated_budget(token_budget)
    sizes = _validated_lengths(lengths, budget)
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (room, bin index), sorted
    for index in _decreasing_order(sizes):
        size = sizes[index]
        k = bisect.bisect_left(open_bins, (size, -1))  # least room >= size, then lowest bin index
        if k == len(open_bins):
            slot, room = len(bins), budget
            bins.append([])
        else:
            room, slot = open_bins.pop(k)
        bins[slot].append(index)
        bisect.insort(open_bins, (room - size, slot))
    assert all(room >= 0 for room, _ in open_bins)
    return bins


def pack_minimum_bin_slack(
    lengths: Sequence[int], token_budget: int, max_backtracks_per_bin: int = MBS_MAX_BACKTRACKS_PER_BIN
) -> list[list[int]]:
    """Minimum bin slack, one bin at a time: the longest remaining sample plus the subset of the others
    that leaves the least room (depth-first, longest first, one branch per distinct length; its first
    descent is the greedy fill), searched until slack 0 or ``max_backtracks_per_bin`` dead ends.
    ValueError as :func:`pack_first_fit_decreasing`, or for ``max_backtracks_per_bin < 1``."""
    budget = _validated_budget(token_budget)
    sizes = _validated_lengths(lengths, budget)
    max_backtracks = _as_int("max_backtracks_per_bin", max_backtracks_per_bin)
    if max_backtracks < 1:
        raise ValueError(f"max_backtracks_per_bin must be >= 1, got {max_backtracks}")
    remaining = _decreasing_order(sizes)
    bins: list[list[int]] = []
    while remaining:
        first, rest = remaining[0], remaining[1:]
        chosen = _min_slack_subset([sizes[i] for i in rest], budget - sizes[first], max_backtracks)
        bins.append([first] + [rest[k] for k in chosen])
        taken = set(chosen)
        remaining = [i for k, i in enumerate(rest) if k not in taken]
    return bins


def pack_micro_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """The packer's packing: BFD, or MBS' when BFD needs more than ``lower_bound_bins + 1`` bins and
    MBS' uses fewer (it is ~100x slower: ~1 ms per bin). Args and errors as :func:`pack_first_fit_decreasing`."""
    bins = pack_best_fit_decreasing(lengths, token_budget)
    if len(bins) > lower_bound_bins(lengths, token_budget) + 1:
        alternative = pack_minimum_bin_slack(lengths, token_budget)
        if len(alternative) < len(bins):
            return alternative
    return bins


def plan_step_micro_batches(lengths: Sequence[int], token_budget: int, num_ranks: int = 1) -> list[list[list[int]]]:
    """``plan[rank][micro_batch]``: a step's :func:`pack_micro_batches` bins shared among ``num_ranks``
    data-parallel ranks, each getting ``ceil(bins / num_ranks)`` micro-batches (collectives need the
    same count; a short rank's last ones are empty ``[]``, run as a zero-loss dummy), largest bin
    first to the rank with the fewest tokens (Graham's LPT rule, 1969). ValueError as
    :func:`pack_first_fit_decreasing`, or for ``num_ranks < 1``."""
    ranks = _as_int("num_ranks", num_ranks)
    if ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {ranks}")
    bins = pack_micro_batches(lengths, token_budget)
    slots = -(-len(bins) // ranks)
    bin_tokens = [sum(lengths[i] for i in b) for b in bins]
    plan: list[list[list[int]]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for b in sorted(range(len(bins)), key=lambda b: (-bin_tokens[b], b)):
        rank = min((r for r in range(ranks) if len(plan[r]) < slots), key=lambda r: (load[r], r))
        plan[rank].append(bins[b])
        load[rank] += bin_tokens[b]
    for micro_batches in plan:
        micro_batches.extend([] for _ in range(slots - len(micro_batches)))
    return plan


def _as_int(name: str, value: object) -> int:
    """`value` as a Python int (numpy ints accepted); ValueError naming `name` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _validated_lengths(lengths: Sequence[int], budget: int) -> list[int]:
    """Lengths as ints in [1, budget]; ValueError names the first bad sample index and the fix."""
    sizes = [_as_int(f"lengths[{i}]", n) for i, n in enumerate(lengths)]
    for i, size in enumerate(sizes):
        if size < 1:
            raise ValueError(f"lengths[{i}] must be >= 1, got {size}; drop empty samples before packing")
        if size > budget:
            raise ValueError(
                f"sample {i} has {size} tokens, more than token_budget={budget}; "
                "truncate it (or filter it) upstream, or raise token_budget"
            )
    return sizes


def _validated_budget(token_budget: int) -> int:
    """`token_budget` as an int >= 1; ValueError otherwise."""
    budget = _as_int("token_budget", token_budget)
    if budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {budget}")
    return budget


def _decreasing_order(sizes: list[int]) -> list[int]:
    """Sample indices by decreasing length, equal lengths by increasing index."""
    return sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))


def _min_slack_subset(sizes: list[int], room: int, max_backtracks: int) -> list[int]:
    """Positions of the subset of ``sizes`` (non-increasing) with the least ``room - sum >= 0`` found
    (iterative search, see :func:`pack_minimum_bin_slack`)."""
    neg = [-size for size in sizes]  # non-decreasing, for bisect
    n = len(sizes)
    next_distinct = [n] * n
    for k in range(n - 2, -1, -1):
        next_distinct[k] = k + 1 if sizes[k + 1] != sizes[k] else next_distinct[k + 1]

    def first_fitting(lo: int, free: int) -> int:
        return bisect.bisect_left(neg, -free, lo)  # first position >= lo with size <= free

    best, best_slack = [], room
    chosen: list[int] = []
    frames = [(first_fitting(0, room), room)]  # (next candidate position, room at this depth)
    backtracks = 0
    while frames and best_slack > 0 and backtracks < max_backtracks:
        k, free = frames[-1]
        if k >= n:
            frames.pop()
            if chosen:
                chosen.pop()
            backtracks += 1
            continue
        left = free - sizes[k]
        chosen.append(k)
        if left < best_slack:
            best, best_slack = list(chosen), left
        frames[-1] = (first_fitting(next_distinct[k], free), free)
        frames.append((first_fitting(k + 1, left), left))
    return best
