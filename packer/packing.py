"""Padding-free packing of samples into micro-batches under a token budget (bin packing).

A micro-batch is one packed row of at most `token_budget` tokens holding whole samples (a sample
is never split). Packing is First-Fit Decreasing (FFD), which uses at most 11/9 OPT + 6/9 bins
(Dosa 2007, "The Tight Bound of First Fit Decreasing Bin-Packing Algorithm Is
FFD(I) <= 11/9 OPT(I) + 6/9"), and in practice close to the lower bound ceil(sum / budget).

Invariants (of every function here):
- every sample index appears in exactly one bin; no bin's total length exceeds the budget;
- the result depends only on the inputs (ties broken by sample index), never on hash order or time.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

__all__ = ["pack_first_fit_decreasing", "plan_step_micro_batches"]


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
    budget = _as_int("token_budget", token_budget)
    if budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {budget}")
    sizes = _validated_lengths(lengths, budget)
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for index in order:
        size = sizes[index]
        slot = next((b for b, free in enumerate(room) if free >= size), len(bins))
        if slot == len(bins):
            bins.append([])
            room.append(budget)
        bins[slot].append(index)
        room[slot] -= size
    assert all(free >= 0 for free in room)
    return bins


def plan_step_micro_batches(
    lengths: Sequence[int], token_budget: int, num_ranks: int = 1
) -> list[list[list[int]]]:
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
        `plan[rank][micro_batch]` = list of sample indices (a bin of `pack_first_fit_decreasing`,
        or `[]` for padding); all ranks have the same number of micro-batches, padding last.

    Raises:
        ValueError: as `pack_first_fit_decreasing`, or `num_ranks` is not an int >= 1.
    """
    ranks = _as_int("num_ranks", num_ranks)
    if ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {ranks}")
    bins = pack_first_fit_decreasing(lengths, token_budget)
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
