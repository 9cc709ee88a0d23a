"""``busctl report RUN_DIR``: plots and a short text summary of a run, from its files alone.

Reads (only ``metrics.jsonl`` is required):

- ``metrics.jsonl`` (:mod:`trainer.proc`, :mod:`trainer.eval_log`): training records
  ``{"step": s + 1, "reward_mean", "kl", "entropy", "policy_lag_mean", "policy_lag_max",
  "tokens_per_s", "step_time_s", "num_tokens", "reward/<fn>", ...}`` and eval records
  ``{"step": round, "eval/<task>/reward_mean", ...}`` (older runs: ``eval_reward_mean``, shown as
  task ``eval``). A line that is not a JSON object (a trainer killed mid-write) is skipped and
  counted; a step written twice keeps its last record.
- ``stages.jsonl`` (optional; one line per metrics-poller round of the supervisor):
  ``{"time": unix_s, "step": steps done, "components": {"producer-0": {"role": "producer",
  "throughput": {"tokens_per_s": x, "samples_per_s": y}, "busy": f, ...}, ...}}``; per step and
  stage (role) the report sums tokens/s over the replicas and averages their busy fraction.
  ``components`` may also be ``status.json``'s list of rows (each with ``name``).
- ``samples.jsonl`` (optional, :mod:`packer.samples`), ``accounting.json`` (prompt outcomes) and
  ``metrics_final/packer.prom`` (the packer's groups by outcome) for the summary.

Writes ``OUT/*.png`` (:mod:`bus.report_plots`, matplotlib's Agg backend) and ``OUT/summary.txt``
(also printed); ``OUT`` defaults to ``RUN_DIR/report``. A series a run does not have (no entropy
in old runs, no eval, no ``stages.jsonl``) is skipped and named in the summary's notes.

The reward summary uses a trailing moving average over ``W = clamp(n // 4, 1, 10)`` steps
(:func:`smoothing_window`): ``first`` is the mean of the first ``W`` steps, ``last`` of the last
``W``, ``best`` the highest ``W``-step mean.

Exit codes: 0 written; 2 no such run directory, or ``metrics.jsonl`` missing, empty or without
training records (the message names the file).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["ReportError", "RunData", "cmd_report", "format_summary", "load_run", "moving_average", "smoothing_window",
           "summarize", "write_report"]

LEGACY_EVAL_TASK = "eval"
"""Task name shown for the ``eval_<metric>`` records of runs older than per-task eval."""


class ReportError(ValueError):
    """The run directory cannot be reported on; the message names the file and the fix."""


@dataclass
class RunData:
    """What a report reads from one run directory.

    Attributes:
        run_dir: the run directory.
        steps: training records of ``metrics.jsonl``, one per step, sorted by ``step``.
        evals: task -> ``[(round, {metric: value})]`` sorted by round.
        stages: records of ``stages.jsonl`` (empty without the file).
        samples: records of ``samples.jsonl`` (empty without the file).
        accounting: ``accounting.json`` or None. packer_outcomes: ``rlbus_packer_groups_total``
            by outcome from ``metrics_final/packer.prom`` (empty without it).
        skipped_lines: unparsable lines per file name.
    """

    run_dir: Path
    steps: list[dict]
    evals: dict[str, list[tuple[int, dict[str, float]]]]
    stages: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    accounting: dict | None = None
    packer_outcomes: dict[str, float] = field(default_factory=dict)
    skipped_lines: dict[str, int] = field(default_factory=dict)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of a training-record key, over the records that have it."""
        pts = [(r["step"], float(r[key])) for r in self.steps if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [p[1] for p in pts]

    def keys(self) -> set[str]:
        """Every key of any training record."""
        return {k for r in self.steps for k in r}


def _read_jsonl(path: Path, skipped: dict[str, int]) -> list[dict]:
    """The JSON objects of ``path``, one per line; other lines are counted in ``skipped``."""
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            out.append(obj)
        else:
            skipped[path.name] = skipped.get(path.name, 0) + 1
    return out


def _eval_entries(record: dict) -> dict[str, dict[str, float]]:
    """``{task: {metric: value}}`` of an eval record (none for a training record)."""
    tasks: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        if key.startswith("eval/") and key.count("/") >= 2:
            task, metric = key[len("eval/"):].split("/", 1)
            tasks.setdefault(task, {})[metric] = value
        elif key.startswith("eval_"):
            tasks.setdefault(LEGACY_EVAL_TASK, {})[key[len("eval_"):]] = value
    return tasks


def packer_outcomes(prom_text: str) -> dict[str, float]:
    """``rlbus_packer_groups_total`` by ``outcome`` from a Prometheus text snapshot."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(prom_text):
        for s in family.samples:
            if s.name == "rlbus_packer_groups_total":
                out[s.labels.get("outcome", "?")] = out.get(s.labels.get("outcome", "?"), 0.0) + float(s.value)
    return out


def load_run(run_dir: Path) -> RunData:
    """Read a run directory (see the module docstring).

    Raises:
        ReportError: no such directory; ``metrics.jsonl`` missing, empty, or without a training
            record.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"no run directory {run_dir}; give the run_dir of a run (e.g. runs/reverse_text)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} does not exist: the run has not trained a step yet (the trainer writes it after each step)")
    skipped: dict[str, int] = {}
    records = _read_jsonl(path, skipped)
    if not records:
        raise ReportError(f"{path} is empty: the run has not trained a step yet")
    steps: dict[int, dict] = {}
    evals: dict[str, dict[int, dict[str, float]]] = {}
    for r in records:
        if not isinstance(r.get("step"), int):
            skipped[path.name] = skipped.get(path.name, 0) + 1
            continue
        entries = _eval_entries(r)
        if entries:
            for task, metrics in entries.items():
                evals.setdefault(task, {})[r["step"]] = metrics
        else:
            steps[r["step"]] = r  # a step written twice (resume): the last record wins
    if not steps:
        raise ReportError(f"{path} holds no training step records ({len(records)} eval records only): nothing to report yet")
    run = RunData(
        run_dir=run_dir,
        steps=[steps[s] for s in sorted(steps)],
        evals={task: sorted(rounds.items()) for task, rounds in sorted(evals.items())},
        skipped_lines=skipped,
    )
    if (run_dir / "stages.jsonl").is_file():
        run.stages = _read_jsonl(run_dir / "stages.jsonl", skipped)
    if (run_dir / "samples.jsonl").is_file():
        run.samples = _read_jsonl(run_dir / "samples.jsonl", skipped)
    try:
        run.accounting = json.loads((run_dir / "accounting.json").read_text())
    except (OSError, ValueError):
        run.accounting = None
    try:
        run.packer_outcomes = packer_outcomes((run_dir / "metrics_final" / "packer.prom").read_text())
    except (OSError, ValueError):
        run.packer_outcomes = {}
    return run


def smoothing_window(n: int) -> int:
    """Steps per moving-average window for a run of ``n`` steps: ``clamp(n // 4, 1, 10)``."""
    return max(1, min(10, n // 4))


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing moving average: ``out[i] = mean(values[max(0, i - window + 1) : i + 1])``,
    ignoring non-finite values (NaN when a window has none).

    Raises:
        ValueError: ``window < 1``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


def stage_series(stages: list[dict]) -> dict[str, dict[str, tuple[list[int], list[float]]]]:
    """Per stage (component role): ``{"tokens_per_s": (steps, values), "busy": (steps, values)}``
    from ``stages.jsonl``; each poll round sums tokens/s over a role's replicas and averages their
    busy fractions, then rounds of the same step are averaged. Null values are left out."""
    per: dict[str, dict[str, dict[int, list[float]]]] = {}
    for rec in stages:
        step = rec.get("step")
        if not isinstance(step, int):
            continue
        by_role: dict[str, dict[str, list[float]]] = {}
        comps = rec.get("components") or {}
        if isinstance(comps, list):  # status.json's rows as they are: [{"name": ..., "role": ..., ...}]
            comps = {c.get("name", "?"): c for c in comps if isinstance(c, dict)}
        for name, comp in comps.items():
            if not isinstance(comp, dict):
                continue
            role = comp.get("role") or (name.rsplit("-", 1)[0] if name.rsplit("-", 1)[-1].isdigit() else name)
            tput = comp.get("throughput") or {}
            values = by_role.setdefault(role, {"tokens_per_s": [], "busy": []})
            if isinstance(tput.get("tokens_per_s"), (int, float)):
                values["tokens_per_s"].append(float(tput["tokens_per_s"]))
            if isinstance(comp.get("busy"), (int, float)):
                values["busy"].append(float(comp["busy"]))
        for role, values in by_role.items():
            for key, vals in values.items():
                if vals:
                    agg = sum(vals) if key == "tokens_per_s" else sum(vals) / len(vals)
                    per.setdefault(role, {}).setdefault(key, {}).setdefault(step, []).append(agg)
    return {
        role: {key: (sorted(pts), [sum(pts[s]) / len(pts[s]) for s in sorted(pts)]) for key, pts in keys.items()}
        for role, keys in per.items()
    }


def _mean(values: list[float]) -> float:
    vals = [v for v in values if math.isfinite(v)]
    return sum(vals) / len(vals) if vals else math.nan


def summarize(run: RunData) -> dict:
    """The summary's numbers (see the module docstring for the reward windows).

    Returns:
        ``{"steps", "first_step", "last_step", "train_time_s", "window", "reward_first",
        "reward_last", "reward_best", "reward_best_step", "reward_terms_last": {fn: v},
        "evals": {task: {"first": (round, v), "last": (round, v)}}, "kl_mean", "entropy_mean",
        "lag_mean", "lag_max", "tokens_per_s", "stages": {role: {"tokens_per_s", "busy"}},
        "packer_outcomes", "accounting", "samples", "sample_steps"}``; NaN where a run lacks the key.
    """
    steps, rewards = run.series("reward_mean")
    w = smoothing_window(len(rewards))
    ma = moving_average(rewards, w)
    full = ma[w - 1 :]
    best_i = max(range(len(full)), key=lambda i: full[i] if math.isfinite(full[i]) else -math.inf) if full else None
    times = run.series("step_time_s")[1]
    tokens = run.series("num_tokens")[1]
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
            k[len("reward/"):]: _mean(run.series(k)[1][-w:]) for k in sorted(run.keys()) if k.startswith("reward/")
        },
        "evals": {
            task: {"first": (rounds[0][0], rounds[0][1].get("reward_mean", math.nan)),
                   "last": (rounds[-1][0], rounds[-1][1].get("reward_mean", math.nan))}
            for task, rounds in run.evals.items()
        },
        "kl_mean": _mean(run.series("kl")[1]),
        "entropy_mean": _mean(run.series("entropy")[1]),
        "lag_mean": _mean(run.series("policy_lag_mean")[1]),
        "lag_max": max(lag_max) if lag_max else math.nan,
        "tokens_per_s": sum(tokens) / sum(times) if tokens and len(tokens) == len(times) and sum(times) > 0
        else _mean(run.series("tokens_per_s")[1]),
        "stages": {
            role: {key: _mean(vals) for key, (_, vals) in series.items()} for role, series in stage_series(run.stages).items()
        },
        "packer_outcomes": dict(run.packer_outcomes),
        "accounting": run.accounting,
        "samples": len(run.samples),
        "sample_steps": len({r.get("step") for r in run.samples}),
    }
    return s


def _f(v: float, digits: int = 4) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}g}"


def format_summary(run: RunData, s: dict, notes: list[str]) -> str:
    """The text of ``summary.txt`` from :func:`summarize`'s numbers and the plotting notes."""
    lines = [
        f"run: {run.run_dir}",
        f"steps: {s['steps']} (records step {s['first_step']}..{s['last_step']}), "
        f"training time {_f(s['train_time_s'])} s (sum of step_time_s)",
        f"reward_mean ({s['window']}-step mean): first {_f(s['reward_first'])}, last {_f(s['reward_last'])}, "
        f"best {_f(s['reward_best'])} (window ending at step {s['reward_best_step']})",
    ]
    if s["reward_terms_last"]:
        lines.append("reward terms (last window): " + ", ".join(f"{k} {_f(v)}" for k, v in s["reward_terms_last"].items()))
    for task, e in s["evals"].items():
        lines.append(f"eval {task} reward_mean: first {_f(e['first'][1])} (round {e['first'][0]}), "
                     f"last {_f(e['last'][1])} (round {e['last'][0]})")
    if not s["evals"]:
        lines.append("eval: no eval records")
    lines.append(f"kl mean {_f(s['kl_mean'])}, entropy mean {_f(s['entropy_mean'])}")
    lines.append(f"policy lag: mean {_f(s['lag_mean'])}, max {_f(s['lag_max'])} steps")
    lines.append(f"trainer throughput: {_f(s['tokens_per_s'])} tokens/s (all tokens / training time)")
    for role, v in s["stages"].items():
        busy = v.get("busy", math.nan)
        lines.append(f"stage {role}: {_f(v.get('tokens_per_s', math.nan))} tokens/s, busy "
                     f"{'n/a' if not math.isfinite(busy) else f'{100 * busy:.0f}%'} (mean over polls)")
    seen = {k: v for k, v in sorted(s["packer_outcomes"].items()) if v or k == "accepted"}  # pre-initialised zeros left out
    if seen:
        lines.append("packer groups by outcome: " + ", ".join(f"{k} {v:g}" for k, v in seen.items()))
    acc = s["accounting"]
    if acc:
        outcomes = ", ".join(f"{k} {v}" for k, v in (acc.get("outcomes") or {}).items())
        lines.append(f"prompts: issued {acc.get('issued')}; outcomes {outcomes}; unresolved {len(acc.get('unresolved') or [])}")
    lines.append(f"samples.jsonl: {s['samples']} examples from {s['sample_steps']} steps")
    for name, n in run.skipped_lines.items():
        notes.append(f"{name}: skipped {n} line(s) that are not JSON records")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, out_dir: Path | None = None) -> tuple[list[Path], str]:
    """Write the plots and ``summary.txt`` of a run.

    Args:
        run_dir: the run directory. out_dir: where to write (default ``RUN_DIR/report``; created).

    Returns:
        ``(png_paths, summary_text)``.

    Raises:
        ReportError: as :func:`load_run`.
    """
    from bus.report_plots import plot_run  # matplotlib only when a report is made

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
        console.print(f"[red]busctl report: {err}[/red]")
        return 2
    print(text, end="")
    out = paths[0].parent if paths else Path(ns.out or Path(ns.run_dir) / "report")
    console.print(f"{len(paths)} plot(s) and summary.txt in {out}")
    return 0
