"""Packing quality: micro-batch count against the lower bound, padding and fill, time to pack.

Run: `python -m bench.packing [--seeds N]` (default 300). Prints two markdown tables: one row per (length mix,
token budget, samples) with the lower bound L1 = ceil(total / budget), the micro-batch counts of first-fit and
best-fit decreasing and the packer's choice (`pack_micro_batches`), the padding the same micro-batches would
carry if right-padded, the fill ratio and the time to pack; and, over `--seeds` random draws per mix, how often
BFD and the packer exceed L1 + 1. The mixes are :func:`length_mix`'s. Results: bench/README.md, "Packing
quality".
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from packer.packing import (
    lower_bound_bins,
    pack_best_fit_decreasing,
    pack_first_fit_decreasing,
    pack_micro_batches,
)

MIXES = ("uniform", "lognormal", "bimodal", "tiny", "capped")


def length_mix(kind: str, num_samples: int, budget: int, rng: np.random.Generator) -> list[int]:
    """`[num_samples]` sample lengths (ints in [1, budget], B = budget) of mix `kind`: uniform [16, B/2]; lognormal
    exp(N(log(B/16), 1)); bimodal half ~N(B/40, B/80), half ~N(B/5, B/40); tiny [1, 32]; capped: one prompt length
    p in [20, B/8), completions uniform in [1, B/4 - p] with 30% at exactly B/4 - p (the hard case for BFD)."""
    n = num_samples
    if kind == "uniform":
        x = rng.integers(16, budget // 2 + 1, n)
    elif kind == "lognormal":
        x = np.exp(rng.normal(np.log(budget / 16), 1.0, n))
    elif kind == "bimodal":
        x = np.where(
            rng.random(n) < 0.5, rng.normal(budget / 5, budget / 40, n), rng.normal(budget / 40, budget / 80, n)
        )
    elif kind == "tiny":
        x = rng.integers(1, 33, n)
    elif kind == "capped":
        prompt = int(rng.integers(20, budget // 8))
        max_tokens = budget // 4 - prompt
        x = prompt + np.where(rng.random(n) < 0.3, max_tokens, rng.integers(1, max_tokens + 1, n))
    else:
        raise ValueError(f"unknown mix {kind!r}; use one of {MIXES}")
    return np.clip(np.round(x), 1, budget).astype(int).tolist()


def padded_ratio(lengths: list[int], bins: list[list[int]]) -> float:
    """Pad tokens / row tokens if each micro-batch were right-padded to its longest sample:
    sum_b (|b| * max_{i in b} L_i - sum_{i in b} L_i) / sum_b |b| * max_{i in b} L_i."""
    rows = sum(len(b) * max(lengths[i] for i in b) for b in bins)
    return (rows - sum(lengths)) / rows if rows else 0.0


def median_ms(fn, *args, repeats: int = 5) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls, milliseconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(*args)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def detail_table(seed: int) -> list[str]:
    """Table 1 (module docstring) as markdown lines."""
    lines = [
        "| mix | budget | samples | total tokens | lower bound | bins FFD | bins BFD | bins packer | padding ratio "
        "(packed) "
        "| padding ratio if padded | fill ratio | ms FFD | ms BFD | ms packer |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in MIXES:
        for budget in (4096, 8192):
            for n in (64, 256, 1024):
                lengths = length_mix(kind, n, budget, np.random.default_rng([seed, budget, n]))
                total = sum(lengths)
                bound = lower_bound_bins(lengths, budget)
                ffd = pack_first_fit_decreasing(lengths, budget)
                bfd = pack_best_fit_decreasing(lengths, budget)
                chosen = pack_micro_batches(lengths, budget)
                packed_pad = 0.0  # rows are the samples back to back: row tokens == total
                lines.append(
                    f"| {kind} | {budget} | {n} | {total:,} | {bound} | {len(ffd)} | {len(bfd)} | {len(chosen)} "
                    f"| {packed_pad:.0%} | {padded_ratio(lengths, chosen):.1%} | {total / (len(chosen) * budget):.3f} "
                    f"| {median_ms(pack_first_fit_decreasing, lengths, budget):.2f} "
                    f"| {median_ms(pack_best_fit_decreasing, lengths, budget):.2f} "
                    f"| {median_ms(pack_micro_batches, lengths, budget):.2f} |"
                )
    return lines


def summary_table(num_seeds: int) -> list[str]:
    """Table 2 (module docstring) as markdown lines."""
    lines = [
        "| mix | draws | BFD > bound + 1 | packer > bound + 1 | max excess BFD | max excess packer | slowest packer "
        "(ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in MIXES:
        over_bfd = over = excess_bfd = excess = 0
        slowest = 0.0
        for seed in range(num_seeds):
            rng = np.random.default_rng([seed, MIXES.index(kind)])
            budget = int(rng.choice([4096, 8192]))
            lengths = length_mix(kind, int(rng.integers(64, 1025)), budget, rng)
            bound = lower_bound_bins(lengths, budget)
            bfd = len(pack_best_fit_decreasing(lengths, budget)) - bound
            started = time.perf_counter()
            chosen = len(pack_micro_batches(lengths, budget)) - bound
            slowest = max(slowest, (time.perf_counter() - started) * 1e3)
            over_bfd += bfd > 1
            over += chosen > 1
            excess_bfd, excess = max(excess_bfd, bfd), max(excess, chosen)
        lines.append(
            f"| {kind} | {num_seeds} | {over_bfd} ({over_bfd / num_seeds:.1%}) | {over} ({over / num_seeds:.1%}) "
            f"| {excess_bfd} | {excess} | {slowest:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="seed of table 1's length draws")
    parser.add_argument("--seeds", type=int, default=300, help="random draws per mix in table 2")
    args = parser.parse_args()
    print("\n".join(detail_table(args.seed)))
    print()
    print("\n".join(summary_table(args.seeds)))


if __name__ == "__main__":
    main()
