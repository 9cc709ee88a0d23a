"""PNG plots of a scale-simulation sweep (:func:`plot_all`; needs matplotlib, the ``bench`` extra).

Two figures from the summaries of :func:`bench.scale_stats.summarize`:
``<stem>_grid.png`` (the ``grid`` sweep, x = producers) and
``<stem>_sizes.png`` (the ``sizes`` sweep, x = RolloutGroup bytes). Each has four panels:
groups/s per hop against the ideal (simulated capacity), latency p50/p99 per hop and the hub's
fan-out, CPU per process (cores), and peak RSS per process (MiB).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HOPS = ("prompts", "rollouts", "scored", "trained")
LATENCIES = ("rollouts", "scored_to_step", "packer")


def _panels(points: list[dict], xs: list[float], xlabel: str, title: str, path: Path) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    for hop in HOPS:
        ax.plot(xs, [p["rate_groups_s"][hop] for p in points], marker="o", label=hop)
    ax.plot(xs, [p["ideal_groups_s"] for p in points], "k--", label="ideal (sim capacity)")
    ax.set_ylabel("groups/s")
    ax.set_title("throughput per hop")
    ax = axes[0][1]
    for hop in LATENCIES:
        ax.plot(xs, [p["latency"][hop]["p50_ms"] for p in points], marker="o", label=f"{hop} p50")
        ax.plot(xs, [p["latency"][hop]["p99_ms"] for p in points], marker="x", linestyle=":", label=f"{hop} p99")
    ax.plot(xs, [p["fanout"]["p99_ms"] for p in points], "k-", marker="s", label="hub fan-out p99")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.set_title("latency per hop")
    names = sorted({k for p in points for k in p["cpu_per_s"]})
    ax = axes[1][0]
    for name in names:
        ax.plot(xs, [p["cpu_per_s"].get(name, 0.0) for p in points], marker="o", label=name)
    ax.set_ylabel("CPU cores (CPU s / wall s)")
    ax.set_title("CPU per process")
    ax = axes[1][1]
    for name in names:
        ax.plot(xs, [p["rss_max_mib"].get(name, 0.0) for p in points], marker="o", label=name)
    ax.set_ylabel("MiB")
    ax.set_title("peak RSS per process")
    for ax in axes.flat:
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_all(points: list[dict], stem: Path) -> list[Path]:
    """Write the grid and size figures for ``points`` (a figure needs >= 2 points); returns the paths."""
    out = []
    grid = [p for p in points if p.get("sweep") == "grid"]
    if len(grid) >= 2:
        out.append(
            _panels(
                grid,
                [p["producers"] for p in grid],
                "producers (x reward workers)",
                "scale simulation: producers x reward workers",
                stem.with_name(stem.name + "_grid.png"),
            )
        )
    sized = [p for p in points if p.get("sweep") == "sizes"]
    if len(sized) >= 2:
        out.append(
            _panels(
                sized,
                [p["message_bytes"] for p in sized],
                "RolloutGroup bytes",
                f"scale simulation: message size at {sized[0]['producers']}x{sized[0]['rewards']}",
                stem.with_name(stem.name + "_sizes.png"),
            )
        )
    return out
