"""The scale simulation: the real bus, hub, prompt source and packer under N simulated producers
and M simulated reward workers (``python -m bench.scale``; method and results: bench/README.md,
section "Scale simulation").

Two sweeps, each point a short run of its own (:func:`bench.scale_point.run_point`):

- ``--grid 1x1,4x4,...``: producers x reward workers at the default load (:data:`GRID_SPEC`, ~37
  KiB groups; each producer offers ~4 groups/s; ``prompts_per_step`` grows with N so every
  producer has work);
- ``--sizes 1KiB,...,16MiB``: the size of one ``RolloutGroup`` at ``--size-grid`` (default 4x4),
  each producer offering :data:`SIZE_GROUPS_PER_S` groups/s whatever their size.

Writes ``--out`` (default ``bench/results/scale_sim.json``: the points' summaries,
:func:`bench.scale_stats.summarize`) and, if matplotlib is installed, PNG plots next to it
(:mod:`bench.scale_plot`). ``--quick`` is a few-seconds sweep (2x2 and 4x4, small groups) for CI.
Exit code 1 if a point failed to run or its accounting is incomplete (a prompt lost or trained twice).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

from bench.scale_point import run_point
from bench.scale_sim import SimSpec
from bench.scale_stats import markdown_table, summarize

GRID_SPEC = SimSpec(
    group_size=8,
    median_tokens=512,
    sigma=0.5,
    max_tokens=2048,
    prompt_tokens=128,
    tokens_per_s=20_000.0,
    score_s=0.01,
    step_s=0.05,
)
"""Load of a grid point: G=8, lognormal completions around 512 tokens (a group ~37 KiB on the wire),
20k tokens/s per producer (~4 groups/s), 10 ms scoring, 50 ms trainer steps."""

SIZE_GROUPS_PER_S = 4.0
"""Groups per second one producer offers in the size sweep."""

BYTES_PER_TOKEN = 8
"""Wire bytes per completion token of a ``RolloutGroup``: int32 id + float32 logprob."""


def parse_size(text: str) -> int:
    """``"16KiB"``, ``"4MiB"``, ``"512"`` -> bytes.

    Raises:
        ValueError: not a number with an optional KiB/MiB/GiB suffix.
    """
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "": 1}
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits) :]
    if unit not in units or not digits:
        raise ValueError(f"size {text!r}: give bytes with an optional KiB/MiB/GiB suffix, e.g. 16KiB")
    return int(float(digits) * units[unit])


def parse_grid(text: str) -> list[tuple[int, int]]:
    """``"1x1,4x8"`` -> ``[(1, 1), (4, 8)]`` (producers, reward workers).

    Raises:
        ValueError: an entry is not ``PxR`` with positive integers, or more than 64 producers.
    """
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        p, _, r = item.partition("x")
        if not (p.isdigit() and r.isdigit()) or int(p) < 1 or int(r) < 1 or int(p) > 64:
            raise ValueError(f"grid entry {item!r}: want PxR, 1 <= P <= 64 (producers.max_replicas), R >= 1")
        out.append((int(p), int(r)))
    return out


MAX_SAMPLE_TOKENS = 65_536
"""Longest completion the config takes (``sampling.max_tokens``); bigger groups get a larger G."""


def size_spec(message_bytes: int, group_size: int = 8) -> SimSpec:
    """A load whose every ``RolloutGroup`` carries ``message_bytes`` of completion arrays
    (``sigma`` 0: equal lengths) and whose producers offer :data:`SIZE_GROUPS_PER_S` groups/s;
    G grows (powers of two) past ``group_size`` where a completion would exceed
    :data:`MAX_SAMPLE_TOKENS`."""
    while message_bytes // (BYTES_PER_TOKEN * group_size) > MAX_SAMPLE_TOKENS:
        group_size *= 2
    tokens = max(1, message_bytes // (BYTES_PER_TOKEN * group_size))
    return SimSpec(
        group_size=group_size,
        median_tokens=tokens,
        sigma=0.0,
        max_tokens=tokens,
        prompt_tokens=16,
        tokens_per_s=SIZE_GROUPS_PER_S * tokens * group_size,
        score_s=0.005,
        step_s=0.05,
    )


def sweep(points: list[dict], work_dir: Path, keep: bool, timeout_s: float, per_process: int = 16) -> list[dict]:
    """Run every point (``producers``, ``rewards``, ``spec``, ``prompts_per_step``, ``max_steps``,
    ``message_bytes``) in turn; return the summaries (printed as they come)."""
    out = []
    for i, p in enumerate(points):
        run_dir = work_dir / f"point-{i:02d}-{p['producers']}x{p['rewards']}-{p['message_bytes']}"
        started = time.monotonic()
        kwargs = {k: p[k] for k in ("producers", "rewards", "spec", "max_steps", "prompts_per_step")}
        try:
            raw = run_point(run_dir, timeout_s=timeout_s, per_process=per_process, **kwargs)
        except Exception as exc:  # one bad point must not lose the sweep
            print(f"point {run_dir.name} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        s = summarize(run_dir, raw, message_bytes=p["message_bytes"], **kwargs)
        s["sweep"], s["spec"] = p["sweep"], dataclasses.asdict(p["spec"])
        out.append(s)
        r, lat = s["rate_groups_s"], s["latency"]
        print(
            f"{p['producers']:>3}x{p['rewards']:<3} {p['message_bytes']:>9} B  done={s['finished']} "
            f"trained {r['trained']:.1f} g/s (ideal {s['ideal_groups_s']:.1f}), rollouts p50/p99 "
            f"{lat['rollouts']['p50_ms']:.1f}/{lat['rollouts']['p99_ms']:.1f} ms, fan-out p99 "
            f"{s['fanout']['p99_ms']:.1f} ms, "
            f"packer peak RSS {s['rss_max_mib'].get('packer', 0):.0f} MiB (queues: scored inbox "
            f"{s['queue_mib_max'].get('packer:scored/inbox', 0):.0f} MiB, batches not taken / unfinished "
            f"{s['queue_mib_max'].get('packer:batches/outbox_not_taken', 0):.0f} / "
            f"{s['queue_mib_max'].get('packer:batches/outbox_unfinished', 0):.0f} MiB), "
            f"accounting {'complete' if s['accounting']['complete'] else 'INCOMPLETE'}, {s['bottleneck']}, "
            f"{time.monotonic() - started:.0f} s",
            flush=True,
        )
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return out


def plan(grid: list[tuple[int, int]], sizes: list[int], size_grid: tuple[int, int], steps: int) -> list[dict]:
    """The sweep points: the grid at :data:`GRID_SPEC`, then the sizes at ``size_grid``."""
    points = []
    group_bytes = int(GRID_SPEC.median_tokens * GRID_SPEC.group_size * BYTES_PER_TOKEN)
    for p, r in grid:
        points.append(
            dict(
                sweep="grid",
                producers=p,
                rewards=r,
                spec=GRID_SPEC,
                prompts_per_step=max(8, 2 * p),
                max_steps=steps,
                message_bytes=group_bytes,
            )
        )
    for b in sizes:
        p, r = size_grid
        points.append(
            dict(
                sweep="sizes",
                producers=p,
                rewards=r,
                spec=size_spec(b),
                prompts_per_step=max(4, 2 * p),
                max_steps=max(2, steps // 2) if b >= 4 << 20 else steps,
                message_bytes=b,
            )
        )
    return points


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring). Returns the exit code."""
    parser = argparse.ArgumentParser(description="rlbus scale simulation (bench/README.md, 'Scale simulation')")
    parser.add_argument("--grid", default="1x1,2x2,4x4,8x8,16x16,32x32,64x64", help="producers x reward workers points")
    parser.add_argument(
        "--sizes", default="1KiB,16KiB,256KiB,1MiB,4MiB,16MiB", help="RolloutGroup sizes (at --size-grid)"
    )
    parser.add_argument("--size-grid", default="4x4", help="producers x reward workers of the size sweep")
    parser.add_argument("--steps", type=int, default=6, help="trainer steps per point")
    parser.add_argument("--quick", action="store_true", help="a few seconds: grid 2x2,4x4, sizes 1KiB, 3 steps")
    parser.add_argument("--out", type=Path, default=Path("bench/results/scale_sim.json"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/rlbus-scale"), help="run directories of the points")
    parser.add_argument("--keep", action="store_true", help="keep each point's run directory")
    parser.add_argument("--timeout", type=float, default=300.0, help="longest run of one point, seconds")
    parser.add_argument("--per-process", type=int, default=16, help="simulated workers per process (threads)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.grid, args.sizes, args.steps = "2x2,4x4", "1KiB", 3
    grid, sizes, size_grid = (
        parse_grid(args.grid),
        [parse_size(s) for s in args.sizes.split(",") if s],
        parse_grid(args.size_grid)[0],
    )
    points = plan(grid, sizes, size_grid, args.steps)
    results = sweep(points, args.work_dir, args.keep, args.timeout, args.per_process)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "command": " ".join(["python -m bench.scale", *(argv if argv is not None else sys.argv[1:])]),
                "points": results,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}\n\n{markdown_table(results)}\n")
    if not args.no_plots:
        try:
            from bench.scale_plot import plot_all
        except ImportError as exc:  # matplotlib is in the optional `bench` extra
            print(f"no plots ({exc})")
        else:
            for path in plot_all(results, args.out.with_suffix("")):
                print(f"wrote {path}")
    return 0 if len(results) == len(points) and all(s["accounting"]["complete"] for s in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
