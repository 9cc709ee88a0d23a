"""``busctl report RUN_DIR``: plots and a short text summary of a run, from its files alone.

It reads ``metrics.jsonl`` (required: the trainer's step records), ``eval.jsonl`` (the packer's eval records),
``stages.jsonl`` (one line per metrics-poller round: per component its role, throughput and busy fraction; per
stage the report sums tokens/s over the replicas and averages busy), ``samples.jsonl``, ``accounting.json``,
``startup.json`` and ``metrics_final/packer.prom`` (:mod:`busctl.run_data`). A line that is not a JSON object (a
trainer killed mid-write) is skipped and counted; a step written twice keeps its last record; a series a run lacks
is named in the notes. It writes ``OUT/*.png`` (:mod:`busctl.report_plots`) and ``OUT/summary.txt`` (also printed;
``OUT`` defaults to ``RUN_DIR/report``), then the command that opens each experiment tracker of the run. The reward
summary uses the trailing moving average of :func:`busctl.run_data.smoothing_window` steps. Exit codes: 0
written; 2 no run directory, or ``metrics.jsonl`` missing, empty or without training records.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from busctl.failures import failure_lines, read_failures
from busctl.run_data import (
    PHASE_LABELS,
    ReportError,
    RunData,
    load_run,
    moving_average,
    phase_table,
    smoothing_window,
    stage_series,
)
from trackers.opening import tracker_lines
from busctl.stderr import print_error
from busctl.throughput import LOSS_TOKENS, throughput_text, trainer_throughput

__all__ = ["cmd_report", "format_phases", "format_summary", "lag_token_shares", "summarize", "write_report"]


def _mean(values: list[float]) -> float:
    vals = [v for v in values if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def summarize(run: RunData) -> dict:
    """The summary's numbers: ``{"steps", "reward_first", "reward_last", "reward_best", "evals": {task: {"first",
    "last"}}, "kl_mean", "lag_tokens", "stages", "phases", "first_step_s", ...}`` (the dict built below); NaN where
    a run lacks a key. ``reward_first`` / ``last`` / ``best`` are means over the moving-average window."""
    steps, rewards = run.series("reward_mean")
    w = smoothing_window(len(rewards))
    ma = moving_average(rewards, w)
    full = ma[w - 1 :]
    best_i = max(range(len(full)), key=lambda i: full[i] if math.isfinite(full[i]) else -math.inf) if full else None
    times = run.series("step_time_s")[1]
    _, lag_max = run.series("policy_lag_max")
    s = {
        "steps": len(run.steps),
        "first_step": run.steps[0]["step"],
        "last_step": run.steps[-1]["step"],
        "train_time_s": sum(times) if times else math.nan,
        "window": w,
        "reward_first": _mean(rewards[:w]) if rewards else math.nan,
        "reward_last": _mean(rewards[-w:]) if rewards else math.nan,
        "reward_best": full[best_i] if best_i is not None else math.nan,
        "reward_best_step": steps[best_i + w - 1] if best_i is not None else None,
        "reward_terms_last": {
            k[len("reward/") :]: _mean(run.series(k)[1][-w:]) for k in sorted(run.keys()) if k.startswith("reward/")
        },
        "evals": {
            task: {
                "first": (rounds[0][0], rounds[0][1].get("reward_mean", math.nan)),
                "last": (rounds[-1][0], rounds[-1][1].get("reward_mean", math.nan)),
            }
            for task, rounds in run.evals.items()
        },
        "kl_mean": _mean(run.series("kl")[1]),
        "entropy_mean": _mean(run.series("entropy")[1]),
        "lag_mean": _mean(run.series("policy_lag_mean")[1]),
        "lag_max": max(lag_max) if lag_max else math.nan,
        "lag_tokens": lag_token_shares(run),
        "throughput": trainer_throughput(run.steps),
        "stages": {
            role: {key: _mean(vals) for key, (_, vals) in series.items()}
            for role, series in stage_series(run.stages).items()
        },
        "packer_outcomes": dict(run.packer_outcomes),
        "accounting": run.accounting,
        "samples": len(run.samples),
        "sample_steps": len({r.get("step") for r in run.samples}),
        "phases": phase_table(run),
        "first_step_s": float((run.startup or {}).get("first_step_s") or math.nan),
        "failures": read_failures(run.run_dir),  # reward functions, environments, agents that failed
    }
    return s


def _f(v: float, digits: int = 4) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}g}"


def lag_token_shares(run: RunData) -> dict[str, float]:
    """Share of the run's loss tokens sampled at each lag, ``{bucket: share}`` in lag order (sums to 1): the
    per-step ``lag_frac/<bucket>`` weighted by ``num_loss_tokens``; ``{}`` for a run without them."""
    prefix = "lag_frac/"
    buckets = sorted(
        (k[len(prefix) :] for k in run.keys() if k.startswith(prefix)), key=lambda b: (b.startswith(">="), len(b), b)
    )
    totals = dict.fromkeys(buckets, 0.0)
    for r in run.steps:
        n = r.get("num_loss_tokens")
        if isinstance(n, (int, float)) and math.isfinite(n):
            for b in buckets:
                totals[b] += n * float(r.get(prefix + b, 0.0))
    all_tokens = sum(totals.values())
    return {b: v / all_tokens for b, v in totals.items()} if all_tokens > 0 else {}


def format_summary(run: RunData, s: dict, notes: list[str]) -> str:
    """The text of ``summary.txt`` from :func:`summarize`'s numbers and the plotting notes."""
    lines = [
        f"run: {run.run_dir}",
        f"steps: {s['steps']} (records step {s['first_step']}..{s['last_step']}), "
        f"training time {_f(s['train_time_s'])} s (sum of step_time_s)",
        f"reward_mean ({s['window']}-step mean): first {_f(s['reward_first'])}, last {_f(s['reward_last'])}, "
        f"best {_f(s['reward_best'])} (window ending at step {s['reward_best_step']})",
        f"launch to first optimizer step: {_f(s['first_step_s'], 3)} s",
    ]
    if s["reward_terms_last"]:
        lines.append(
            "reward terms (last window): " + ", ".join(f"{k} {_f(v)}" for k, v in s["reward_terms_last"].items())
        )
    for task, e in s["evals"].items():
        lines.append(
            f"eval {task} reward_mean: first {_f(e['first'][1])} (round {e['first'][0]}), "
            f"last {_f(e['last'][1])} (round {e['last'][0]})"
        )
    if not s["evals"]:
        lines.append("eval: no eval records")
    lines.append(f"kl mean {_f(s['kl_mean'])}, entropy mean {_f(s['entropy_mean'])}")
    lines.append(f"policy lag: mean {_f(s['lag_mean'])}, max {_f(s['lag_max'])} steps")
    if s["lag_tokens"]:
        lines.append(
            "loss tokens by lag (steps): " + ", ".join(f"{b} {100 * v:.1f}%" for b, v in s["lag_tokens"].items())
        )
    lines.append(throughput_text(run.steps))
    lines += format_phases(s["phases"])
    for role, v in s["stages"].items():
        busy = v.get("busy", math.nan)
        if role == "trainer" and LOSS_TOKENS in s["throughput"]:  # the figure above, not a second one
            rate = f"{_f(s['throughput'][LOSS_TOKENS])} {LOSS_TOKENS} of step time (metrics.jsonl)"
        else:
            rate = f"{_f(v.get('tokens_per_s', math.nan))} completion tokens/s of wall time"
        busy_text = "n/a" if not math.isfinite(busy) else f"{100 * busy:.0f}%"
        lines.append(f"stage {role}: {rate}, busy {busy_text} (mean over polls)")
    seen = {
        k: v for k, v in sorted(s["packer_outcomes"].items()) if v or k == "accepted"
    }  # pre-initialised zeros left out
    if seen:
        lines.append("packer groups by outcome: " + ", ".join(f"{k} {v:g}" for k, v in seen.items()))
    acc = s["accounting"]
    if acc:
        outcomes = ", ".join(f"{k} {v}" for k, v in (acc.get("outcomes") or {}).items())
        lines.append(
            f"prompts: issued {acc.get('issued')}; outcomes {outcomes}; unresolved {len(acc.get('unresolved') or [])}"
        )
    lines.append(f"samples.jsonl: {s['samples']} examples from {s['sample_steps']} steps")
    lines += [f"failures: {line}" for line in failure_lines(s.get("failures") or {})]
    for name, n in run.skipped_lines.items():
        notes.append(f"{name}: skipped {n} line(s) that are not JSON records")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines) + "\n"


def format_phases(rows: list[tuple[str, float, float, float]]) -> list[str]:
    """The summary's table of where the trainer's step time went (:func:`busctl.run_data.phase_table`)::

        trainer time per step by phase (mean s/step and its share of the mean step time, which add up; median):
          wait_data    (wait )  0.0123 s   3.1%  median   0.0032 s
          ...

    No lines for a run without phase times."""
    if not rows:
        return []
    lines = ["trainer time per step by phase (mean s/step and its share of the mean step time, which add up; median):"]
    for phase, mean, share, median in rows:
        pct = "n/a" if not math.isfinite(share) else f"{100 * share:5.1f}%"
        label = PHASE_LABELS.get(phase, phase)
        lines.append(f"  {phase:<12} ({label:<5}) {mean:8.4f} s  {pct:>6}  median {median:8.4f} s")
    return lines


def write_report(run_dir: Path, out_dir: Path | None = None) -> tuple[list[Path], str]:
    """Write the plots and ``summary.txt`` of ``run_dir`` into ``out_dir`` (default ``RUN_DIR/report``; created).

    Returns:
        ``(png_paths, summary_text)``.

    Raises:
        ReportError: as :func:`load_run`.
    """
    from busctl.report_plots import plot_run  # matplotlib only when a report is made

    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    paths, notes = plot_run(run, out)
    text = format_summary(run, summarize(run), notes)
    (out / "summary.txt").write_text(text)
    return paths, text


def cmd_report(ns: argparse.Namespace, console) -> int:
    """``busctl report RUN_DIR [--out DIR]``: 0 written, 2 nothing to report (message printed)."""
    try:
        paths, text = write_report(Path(ns.run_dir), Path(ns.out) if ns.out else None)
    except ReportError as err:
        print_error(f"busctl report: {err}")
        return 2
    print(text, end="")
    out = paths[0].parent if paths else Path(ns.out or Path(ns.run_dir) / "report")
    console.print(f"{len(paths)} plot(s) and summary.txt in {out}")
    for line in tracker_lines(Path(ns.run_dir)):  # report.trackers: how to open each
        console.print(line, markup=False, highlight=False)
    return 0
