"""Padding-free packing of samples into micro-batches under a token budget (bin packing).

A micro-batch is one packed row of at most `token_budget` tokens holding whole samples (a sample
is never split), so no row carries padding tokens. The number of micro-batches is bounded below by
`ceil(sum(lengths) / token_budget)` (`lower_bound_bins`). Three packers:

- `pack_first_fit_decreasing` (FFD): each sample, longest first, into the first open bin with room.
  FFD(I) <= 11/9 OPT(I) + 6/9 (Dosa 2007, "The Tight Bound of First Fit Decreasing Bin-Packing
  Algorithm Is FFD(I) <= 11/9 OPT(I) + 6/9"). Kept for comparison (bench/packing.py).
- `pack_best_fit_decreasing` (BFD): the same order, into the open bin with the LEAST room that still
  fits; same worst-case bound as FFD (Johnson 1973), leaves fewer half-empty bins in practice.
- `pack_minimum_bin_slack` (MBS'): fills one bin at a time: the longest remaining sample plus the
  subset of the others that leaves the least room (a bounded depth-first search). Gupta & Ho 1999,
  "A new heuristic algorithm for the one-dimensional bin-packing problem" (Production Planning &
  Control 10(6)); the variant that fixes the longest item first is Fleszar & Hindi 2002, "New
  heuristics for one-dimensional bin-packing" (Computers & Operations Research 29(7)).

`pack_micro_batches` is what the packer uses: BFD, and MBS' only when BFD needs more than
`lower_bound_bins + 1` bins (measured: BFD misses that on mixes whose shortest sample is long,
e.g. a long shared prompt with many completions truncated at the same max_tokens, where every bin
keeps a gap smaller than any sample; MBS' closes those gaps; see bench/README.md).

Invariants (of every function here):
- every sample index appears in exactly one bin; no bin's total length exceeds the budget; no bin is
  empty;
- the result depends only on the inputs (ties broken by sample index, then bin creation order, and
  the MBS' search is bounded by a count of dead ends, never by time), never on hash order or timing.
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
    """The trivial lower bound on the number of bins: L1 = ceil(sum_i lengths_i / token_budget).

    Source: Martello & Toth 1990, "Knapsack Problems", Sec. 8.3 (bound L1). No packing can use
    fewer bins, since a bin holds at most `token_budget` tokens.

    Args:
        lengths: `[num_samples]` ints >= 1, tokens per sample. token_budget: int >= 1.

    Returns:
        The bound, an int >= 0 (0 for no samples).

    Raises:
        ValueError: as `pack_first_fit_decreasing`.
    """
    budget = _validated_budget(token_budget)
    return math.ceil(sum(_validated_lengths(lengths, budget)) / budget)


def pack_first_fit_decreasing(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Pack samples into as few bins of `token_budget` tokens as FFD finds.

    Algorithm: visit samples by decreasing length (equal lengths by increasing index) and put each
    into the first open bin (in creation order) with room for it, else open a new bin.
    Source: Johnson 1973 (FFD); bound in the module docstring.

    Args:
        lengths: `[num_samples]` ints >= 1, tokens per sample.
        token_budget: int >= 1, the most tokens one bin (packed row) may hold.

    Returns:
        Bins in creation order; each bin lists sample indices (into `lengths`) in the order they
        were placed (non-increasing length). `sum(lengths[i] for i in bin) <= token_budget`.
        An empty `lengths` gives `[]`.

    Raises:
        ValueError: `token_budget` is not an int >= 1; a length is not an int >= 1; or a sample is
            longer than `token_budget` (the message names its index; truncate it or raise the budget).
    """
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
    """Pack samples with Best-Fit Decreasing.

    Algorithm: visit samples by decreasing length (equal lengths by increasing index) and put each
    into the open bin with the least room that still fits it (equal room: the bin created first),
    else open a new bin. Open bins are kept sorted by `(room, creation index)`, so each placement
    is one binary search: O(n log n) comparisons. Source: Johnson 1973 (BFD), see module docstring.

    Args, Returns, Raises: as `pack_first_fit_decreasing`.
    """
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
    """Pack samples with Minimum Bin Slack (MBS', one bin at a time).

    Algorithm: while samples remain, open a bin with the longest remaining one, then search the
    other remaining samples (longest first, depth-first, one branch per distinct length at each
    level) for the subset that leaves the least room ("slack") in the bin; stop at slack 0 or after
    `max_backtracks_per_bin` dead ends, and close the bin with the best subset found. The first
    descent is the greedy fill and always completes, so a bin is never worse than first-fit
    decreasing over the remaining samples. Source: Gupta & Ho 1999 (MBS), Fleszar & Hindi 2002
    (MBS'), see the module docstring.

    Args:
        lengths, token_budget: as `pack_first_fit_decreasing`.
        max_backtracks_per_bin: int >= 1, most dead ends per bin (bounds time; deterministic).

    Returns:
        Bins in creation order; each bin lists the longest sample first, then the chosen subset in
        non-increasing length.

    Raises:
        ValueError: as `pack_first_fit_decreasing`, or `max_backtracks_per_bin` is not an int >= 1.
    """
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
    """The packer's packing: BFD, or MBS' where BFD needs more than `lower_bound_bins + 1` bins.

    MBS' replaces BFD only if it uses fewer bins (ties keep BFD). It is tried only in that case
    because it is ~100x slower than BFD (about 1 ms per bin in CPython against ~1 us per sample).

    Args, Returns, Raises: as `pack_first_fit_decreasing`.
    """
    bins = pack_best_fit_decreasing(lengths, token_budget)
    if len(bins) > lower_bound_bins(lengths, token_budget) + 1:
        alternative = pack_minimum_bin_slack(lengths, token_budget)
        if len(alternative) < len(bins):
            return alternative
    return bins


def plan_step_micro_batches(lengths: Sequence[int], token_budget: int, num_ranks: int = 1) -> list[list[list[int]]]:
    """Pack one optimizer step's samples and share the micro-batches among data-parallel ranks.

    Every rank must run the same number of forward/backward passes (collectives would hang
    otherwise), so each rank gets exactly `ceil(num_bins / num_ranks)` micro-batches; a rank short
    of real ones gets empty micro-batches `[]` at the end, which the trainer runs as a dummy
    forward with zero loss. Bins are handed out largest-first (by tokens), each to the rank with
    the fewest tokens so far among ranks with a free slot (ties: lowest rank), which balances
    tokens per rank (Graham's LPT rule, 1969).

    Args:
        lengths: `[num_samples]` ints >= 1, tokens per sample.
        token_budget: int >= 1, tokens per micro-batch.
        num_ranks: int >= 1, data-parallel world size.

    Returns:
        `plan[rank][micro_batch]` = list of sample indices (a bin of `pack_micro_batches`,
        or `[]` for padding); all ranks have the same number of micro-batches, padding last.

    Raises:
        ValueError: as `pack_first_fit_decreasing`, or `num_ranks` is not an int >= 1.
    """
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
    """Positions of a subset of `sizes` (non-increasing) with the least `room - sum` >= 0 found.

    Iterative depth-first search (no recursion limit for thousands of tiny samples): at each depth
    try the fitting sizes longest first, one branch per distinct size (a later equal size would
    only repeat the subtree), and keep the best subset seen; stop at slack 0 or after
    `max_backtracks` dead ends (so the first, greedy descent always completes; the work is at most
    `max_backtracks` + its depth pushes).
    """
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
