"""How long ``busctl --help`` takes, and which imports it spends the time on.

Runs ``python -m busctl --help`` in a fresh interpreter ``--runs`` times per source tree and prints
the median wall time (spawn included), then the slowest imports of one ``python -X importtime``
run. Give ``--before DIR`` (a copy of an older tree, e.g. ``git archive COMMIT | tar -x -C DIR``)
to time it against this tree, interleaved run by run so both see the same load on a shared host.

    python -m bench.cli_startup [--runs 5] [--before DIR] [--top 10]

Every ``busctl`` command builds the same parser, so this is the start-up floor of ``busctl status``,
``busctl logs`` and the rest too (before each command's own imports).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _run(tree: Path, *flags: str) -> tuple[float, str]:
    """One ``python [flags] -m busctl --help`` in ``tree``: (wall seconds, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "100"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *flags, "-m", "busctl", "--help"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return time.perf_counter() - start, proc.stderr


def slowest_imports(importtime: str, top: int) -> list[tuple[int, str]]:
    """The ``top`` largest cumulative import times of ``python -X importtime`` output, as
    ``(microseconds, indented module name)``."""
    rows = []
    for line in importtime.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line.split("|")
        rows.append((int(cumulative), name.rstrip()))
    return sorted(rows, reverse=True)[:top]


def main(argv: list[str] | None = None) -> int:
    """Print the medians (and the ratio with ``--before``) and the slowest imports."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per tree (default 5); the median is reported")
    parser.add_argument("--before", type=Path, default=None, help="an older source tree to time against this one")
    parser.add_argument("--top", type=int, default=10, help="slowest imports to list (default 10)")
    args = parser.parse_args(argv)
    trees = {"this tree": REPO_ROOT, **({"before": args.before.resolve()} if args.before else {})}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.runs):
        for name, tree in trees.items():
            times[name].append(_run(tree)[0])
    for name, values in times.items():
        print(
            f"busctl --help, {name}: median {statistics.median(values):.3f} s of {args.runs} "
            f"(min {min(values):.3f}, max {max(values):.3f})"
        )
    if args.before:
        print(
            f"ratio before / this tree: "
            f"{statistics.median(times['before']) / statistics.median(times['this tree']):.2f}x"
        )
    print("slowest imports (cumulative, one -X importtime run of this tree):")
    for micros, name in slowest_imports(_run(REPO_ROOT, "-X", "importtime")[1], args.top):
        print(f"  {micros / 1000:7.1f} ms {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
