"""The PNG plots of ``busctl report`` (matplotlib, Agg backend: no display needed).

One figure per file, x axis = step (``metrics.jsonl``'s ``step``: optimizer steps done; eval:
the round, which evaluates the policy of that version):

- ``reward.png``: ``reward_mean`` per step, its moving average (:func:`busctl.report.moving_average`),
  ``reward_mean +- reward_std`` as a band, and each ``reward/<fn>`` term;
- ``eval_reward.png``: ``eval/<task>/reward_mean`` per task and round;
- ``kl.png``: ``kl`` (and ``kl_penalty``, ``teacher_kl`` where present);
- ``entropy.png``: ``entropy``;
- ``lag.png``: ``policy_lag_mean`` and ``policy_lag_max``;
- ``throughput.png``: the trainer's ``tokens_per_s`` per step and, from ``stages.jsonl``, each
  stage's tokens/s; a second panel with each stage's busy fraction when recorded;
- ``phases.png``: the trainer's seconds per step by phase (``time/<phase>_s``: wait for data,
  forward, backward, optimizer, weight send, bookkeeping), stacked: the top edge is the step time.

A plot whose series are all missing is not written; :func:`plot_run` returns a note for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from busctl.run_data import PHASE_LABELS, moving_average, phase_series, smoothing_window, stage_series

if TYPE_CHECKING:
    from busctl.run_data import RunData

__all__ = ["plot_run"]

DPI = 110
ROLE_ORDER = ("trainer", "producer", "rewards", "packer")
"""Stages get the same colour in every panel: ``C<i>`` by this order, then by name."""
SIZE_IN = (8.0, 4.5)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _figure(title: str, ylabel: str):
    fig, ax = plt.subplots(figsize=SIZE_IN)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and rounds are whole numbers
    return fig, ax


def _lines(run: "RunData", out: Path, name: str, title: str, ylabel: str, keys: list[str], notes: list[str]) -> Path | None:
    """One line per training-record key that the run has; None (and a note) when it has none."""
    present = [k for k in keys if run.series(k)[0]]
    if not present:
        notes.append(f"{name}: not plotted, no {' / '.join(keys)} in metrics.jsonl")
        return None
    fig, ax = _figure(title, ylabel)
    for i, k in enumerate(present):
        x, y = run.series(k)  # later series dashed: equal series (lag mean = max) stay visible
        ax.plot(x, y, marker="." if len(x) < 30 else None, linestyle=("-", "--", ":")[i % 3], label=k)
    ax.legend(loc="best", fontsize="small")
    return _save(fig, out / name)


def _reward(run: "RunData", out: Path, notes: list[str]) -> Path | None:
    x, y = run.series("reward_mean")
    terms = sorted(k for k in run.keys() if k.startswith("reward/"))
    if not x:
        notes.append("reward.png: not plotted, no reward_mean in metrics.jsonl")
        return None
    w = smoothing_window(len(y))
    fig, ax = _figure(f"training reward ({w}-step moving average)", "reward")
    sx, sd = run.series("reward_std")
    if sx == x:
        ax.fill_between(x, [m - d for m, d in zip(y, sd)], [m + d for m, d in zip(y, sd)], alpha=0.12, label="reward_mean ± reward_std")
    ax.plot(x, y, alpha=0.35, marker="." if len(x) < 30 else None, label="reward_mean")
    ax.plot(x, moving_average(y, w), linewidth=2, label=f"reward_mean, {w}-step mean")
    for k in terms:
        tx, ty = run.series(k)
        ax.plot(tx, moving_average(ty, w), linestyle="--", label=f"{k}, {w}-step mean")
    ax.legend(loc="best", fontsize="small")
    return _save(fig, out / "reward.png")


def _eval(run: "RunData", out: Path, notes: list[str]) -> Path | None:
    tasks = {t: [(r, m["reward_mean"]) for r, m in rounds if isinstance(m.get("reward_mean"), (int, float))]
             for t, rounds in run.evals.items()}
    tasks = {t: pts for t, pts in tasks.items() if pts}
    if not tasks:
        notes.append("eval_reward.png: not plotted, no eval records in metrics.jsonl")
        return None
    fig, ax = _figure("eval reward per task", "eval reward_mean")
    ax.set_xlabel("step (eval round = policy version)")
    for task, pts in tasks.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=task)
    ax.legend(loc="best", fontsize="small")
    return _save(fig, out / "eval_reward.png")


def _throughput(run: "RunData", out: Path, notes: list[str]) -> Path | None:
    x, y = run.series("tokens_per_s")
    stages = stage_series(run.stages)
    if not run.stages:
        notes.append("throughput.png: producer/rewards/packer throughput not plotted: no stages.jsonl in the run "
                      "directory (the trainer's tokens/s is)")
    if not x and not stages:
        notes.append("throughput.png: not plotted, no tokens_per_s in metrics.jsonl and no stages.jsonl")
        return None
    busy = {role: s["busy"] for role, s in stages.items() if "busy" in s}
    color = _colors(list(stages))
    fig, axes = plt.subplots(2 if busy else 1, 1, figsize=(SIZE_IN[0], SIZE_IN[1] * (1.6 if busy else 1)), sharex=True, squeeze=False)
    ax = axes[0][0]
    ax.set_title("throughput per stage")
    ax.set_ylabel("tokens/s")
    ax.grid(True, alpha=0.3)
    if x:
        ax.plot(x, y, marker="." if len(x) < 30 else None, color=color["trainer"],
                label="trainer (metrics.jsonl tokens_per_s: prompt + completion tokens)")
    for role, series in stages.items():
        if "tokens_per_s" in series:
            sx, sy = series["tokens_per_s"]
            ax.plot(sx, sy, marker=".", linestyle="--", color=color[role], label=f"{role} (stages.jsonl: completion tokens)")
    ax.legend(loc="best", fontsize="small")
    if busy:
        bx = axes[1][0]
        bx.set_ylabel("busy fraction")
        bx.set_ylim(-0.02, 1.02)
        bx.grid(True, alpha=0.3)
        for role, (sx, sy) in busy.items():
            bx.plot(sx, sy, marker=".", color=color[role], label=role)
        bx.legend(loc="best", fontsize="small")
    axes[-1][0].set_xlabel("step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    return _save(fig, out / "throughput.png")


def _phases(run: "RunData", out: Path, notes: list[str]) -> Path | None:
    """Stacked seconds per step by trainer phase, over the steps that report every phase."""
    phases = phase_series(run)
    if not phases:
        notes.append("phases.png: not plotted, no time/<phase>_s in metrics.jsonl (trainers before per-phase timing)")
        return None
    keys = [f"time/{p}_s" for p in phases]
    rows = [r for r in run.steps if all(isinstance(r.get(k), (int, float)) for k in keys)]
    fig, ax = _figure("trainer time per step by phase (stacked)", "seconds per step")
    ax.stackplot([r["step"] for r in rows], [[float(r[k]) for r in rows] for k in keys],
                 labels=[f"{p} ({PHASE_LABELS.get(p, p)})" for p in phases], alpha=0.85)
    ax.legend(loc="upper left", fontsize="small", ncol=3)
    return _save(fig, out / "phases.png")


def _colors(roles: list[str]) -> dict[str, str]:
    extra = sorted(r for r in roles if r not in ROLE_ORDER)
    return {r: f"C{i % 10}" for i, r in enumerate([*ROLE_ORDER, *extra])}


def plot_run(run: "RunData", out: Path) -> tuple[list[Path], list[str]]:
    """Write every plot of the module docstring that the run has data for into ``out``.

    Returns:
        ``(paths written, notes)``: a note per plot or series skipped for missing data.
    """
    notes: list[str] = []
    made = [
        _reward(run, out, notes),
        _eval(run, out, notes),
        _lines(run, out, "kl.png", "KL(rollout policy || trained policy) estimate", "nats", ["kl", "kl_penalty", "teacher_kl"], notes),
        _lines(run, out, "entropy.png", "policy entropy on loss tokens", "nats", ["entropy"], notes),
        _lines(run, out, "lag.png", "off-policy lag of trained samples", "steps", ["policy_lag_mean", "policy_lag_max"], notes),
        _throughput(run, out, notes),
        _phases(run, out, notes),
    ]
    return [p for p in made if p is not None], notes
