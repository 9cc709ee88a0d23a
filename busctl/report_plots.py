"""The PNG plots of ``busctl report`` (matplotlib, Agg backend: no display needed).

One figure per file (:func:`build_figures`: reward with its moving average and terms, eval reward per task, KL,
entropy, lag, throughput per stage with busy fractions, trainer phases stacked), x axis = step (eval: the
round, which evaluates the policy of that version). A line equal to another is named in its legend, not drawn
on it; legends sit right of the axes, never over the data. A plot whose series are all missing is not written
and gets a note. :func:`build_figures` returns the figures unwritten (tests read the plotted data).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from busctl.run_data import PHASE_LABELS, moving_average, phase_series, smoothing_window, stage_series
from busctl.throughput import LOSS_TOKENS, step_rates, trainer_throughput

if TYPE_CHECKING:
    from busctl.run_data import RunData

__all__ = ["build_figures", "plot_run"]

DPI = 110
ROLE_ORDER = ("trainer", "producer", "rewards", "packer")
"""Stages get the same colour in every panel: ``C<i>`` by this order, then by name."""
SIZE_IN = (8.0, 4.5)


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # "tight": the legends outside the axes are kept
    plt.close(fig)
    return path


def _legend(ax) -> None:
    """The legend to the right of the axes, outside them: it never covers data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small")


def _figure(title: str, ylabel: str):
    fig, ax = plt.subplots(figsize=SIZE_IN)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and rounds are whole numbers
    return fig, ax


def _lines(run: "RunData", name: str, title: str, ylabel: str, keys: list[str], notes: list[str]):
    """One line per training-record key that the run has; None (and a note) when it has none."""
    present = [k for k in keys if run.series(k)[0]]
    if not present:
        notes.append(f"{name}: not plotted, no {' / '.join(keys)} in metrics.jsonl")
        return None
    fig, ax = _figure(title, ylabel)
    for i, k in enumerate(present):
        x, y = run.series(k)  # later series dashed: equal series (lag mean = max) stay visible
        ax.plot(x, y, marker="." if len(x) < 30 else None, linestyle=("-", "--", ":")[i % 3], label=k)
    _legend(ax)
    return fig


def _same_series(a: tuple[list, list], b: tuple[list, list]) -> bool:
    """Equal steps and values within 1e-9 (relative): the second line would hide under the first."""
    return a[0] == b[0] and all(abs(u - v) <= 1e-9 * max(1.0, abs(u)) for u, v in zip(a[1], b[1]))


def _reward(run: "RunData", notes: list[str]):
    x, y = run.series("reward_mean")
    terms = sorted(k for k in run.keys() if k.startswith("reward/"))
    if not x:
        notes.append("reward.png: not plotted, no reward_mean in metrics.jsonl")
        return None
    w = smoothing_window(len(y))
    fig, ax = _figure(f"training reward ({w}-step moving average)" if w > 1 else "training reward", "reward")
    sx, sd = run.series("reward_std")
    if sx == x:
        ax.fill_between(
            x,
            [m - d for m, d in zip(y, sd)],
            [m + d for m, d in zip(y, sd)],
            alpha=0.12,
            label="reward_mean ± reward_std",
        )
    same = [k for k in terms if _same_series(run.series(k), (x, y))]
    ax.plot(
        x,
        y,
        alpha=0.35 if w > 1 else 1.0,
        marker="." if len(x) < 30 else None,
        label="reward_mean" + (f" (= {', '.join(same)})" if same else ""),
    )
    if w > 1:
        ax.plot(x, moving_average(y, w), linewidth=2, label=f"reward_mean, {w}-step mean")
    for k in terms:
        if k not in same:
            tx, ty = run.series(k)
            ax.plot(tx, moving_average(ty, w), linestyle="--", label=f"{k}, {w}-step mean" if w > 1 else k)
    _legend(ax)
    return fig


def _eval(run: "RunData", notes: list[str]):
    tasks = {
        t: [(r, m["reward_mean"]) for r, m in rounds if isinstance(m.get("reward_mean"), (int, float))]
        for t, rounds in run.evals.items()
    }
    tasks = {t: pts for t, pts in tasks.items() if pts}
    if not tasks:
        notes.append("eval_reward.png: not plotted, no eval records in eval.jsonl")
        return None
    fig, ax = _figure("eval reward per task", "eval reward_mean")
    ax.set_xlabel("step (eval round = policy version)")
    for task, pts in tasks.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=task)
    _legend(ax)
    return fig


def _throughput(run: "RunData", notes: list[str]):
    stages = stage_series(run.stages)
    x, y = step_rates(run.steps, LOSS_TOKENS)  # the figure busctl status and the summary print, per step
    run_rate = trainer_throughput(run.steps).get(LOSS_TOKENS)
    label = f"trainer ({LOSS_TOKENS} of step time; run: {run_rate:,.0f})" if x else ""
    if not x:
        tx, ty = run.series("tokens_per_s")
        if tx and any("tokens_per_s" in s for s in stages.values()):
            notes.append(
                "throughput.png: the trainer's metrics.jsonl line not plotted: no num_loss_tokens (a run "
                "before it was recorded), and its tokens_per_s (prompt + completion) does not compare with "
                "the stages' completion tokens/s"
            )
        elif tx:
            x, y, label = tx, ty, "trainer (metrics.jsonl tokens_per_s: prompt + completion tokens)"
    if not run.stages:
        notes.append(
            "throughput.png: producer/rewards/packer throughput not plotted: no stages.jsonl in the run "
            "directory (the trainer's tokens/s is)"
        )
    if not x and not stages:
        notes.append("throughput.png: not plotted, no tokens_per_s in metrics.jsonl and no stages.jsonl")
        return None
    busy = {role: s["busy"] for role, s in stages.items() if "busy" in s}
    color = _colors(list(stages))
    fig, axes = plt.subplots(
        2 if busy else 1, 1, figsize=(SIZE_IN[0], SIZE_IN[1] * (1.6 if busy else 1)), sharex=True, squeeze=False
    )
    ax = axes[0][0]
    ax.set_title("throughput per stage")
    ax.set_ylabel("completion tokens/s")
    ax.grid(True, alpha=0.3)
    if x:
        ax.plot(x, y, marker="." if len(x) < 30 else None, color=color["trainer"], label=label)
    for role, series in stages.items():
        if "tokens_per_s" in series:
            sx, sy = series["tokens_per_s"]
            ax.plot(
                sx, sy, marker=".", linestyle="--", color=color[role], label=f"{role} (stages.jsonl: completion tokens)"
            )
    _legend(ax)
    if busy:
        bx = axes[1][0]
        bx.set_ylabel("busy fraction")
        bx.set_ylim(-0.02, 1.02)
        bx.grid(True, alpha=0.3)
        for role, (sx, sy) in busy.items():
            bx.plot(sx, sy, marker=".", color=color[role], label=role)
        _legend(bx)
    axes[-1][0].set_xlabel("step")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig


def _phases(run: "RunData", notes: list[str]):
    """Stacked seconds per step by trainer phase, over the steps that report every phase."""
    phases = phase_series(run)
    if not phases:
        notes.append("phases.png: not plotted, no time/<phase>_s in metrics.jsonl (trainers before per-phase timing)")
        return None
    keys = [f"time/{p}_s" for p in phases]
    rows = [r for r in run.steps if all(isinstance(r.get(k), (int, float)) for k in keys)]
    fig, ax = _figure("trainer time per step by phase (stacked)", "seconds per step")
    ax.stackplot(
        [r["step"] for r in rows],
        [[float(r[k]) for r in rows] for k in keys],
        labels=[f"{p} ({PHASE_LABELS.get(p, p)})" for p in phases],
        alpha=0.85,
    )
    _legend(ax)
    return fig


def _colors(roles: list[str]) -> dict[str, str]:
    extra = sorted(r for r in roles if r not in ROLE_ORDER)
    return {r: f"C{i % 10}" for i, r in enumerate([*ROLE_ORDER, *extra])}


def build_figures(run: "RunData") -> tuple[dict, list[str]]:
    """Every figure the run has data for, not written.

    Returns:
        ``({file name: matplotlib Figure}, notes)``: a note per plot or series skipped for missing data. The
        caller closes the figures (``matplotlib.pyplot.close``).
    """
    notes: list[str] = []
    made = {
        "reward.png": _reward(run, notes),
        "eval_reward.png": _eval(run, notes),
        "kl.png": _lines(
            run,
            "kl.png",
            "KL(rollout policy || trained policy) estimate",
            "nats",
            ["kl", "kl_penalty", "teacher_kl"],
            notes,
        ),
        "entropy.png": _lines(run, "entropy.png", "policy entropy on loss tokens", "nats", ["entropy"], notes),
        "lag.png": _lines(
            run, "lag.png", "off-policy lag of trained samples", "steps", ["policy_lag_mean", "policy_lag_max"], notes
        ),
        "throughput.png": _throughput(run, notes),
        "phases.png": _phases(run, notes),
    }
    return {name: fig for name, fig in made.items() if fig is not None}, notes


def plot_run(run: "RunData", out: Path) -> tuple[list[Path], list[str]]:
    """Write every plot the run has data for into ``out``; ``(paths written, notes)``."""
    figures, notes = build_figures(run)
    return [_save(fig, out / name) for name, fig in figures.items()], notes
