"""What ``busctl report`` reads from a run directory, and the series helpers it and its plots share.

:func:`load_run` turns ``metrics.jsonl``, ``eval.jsonl``, ``stages.jsonl``, ``samples.jsonl``, ``accounting.json``,
``startup.json`` and ``metrics_final/packer.prom`` into a :class:`RunData`. It reads and computes only, so
:mod:`busctl.report` and :mod:`busctl.report_plots` both build on it without importing each other.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from runfiles.eval_records import EVAL_FILE

__all__ = [
    "PHASE_LABELS",
    "ReportError",
    "RunData",
    "load_run",
    "moving_average",
    "packer_outcomes",
    "phase_series",
    "phase_table",
    "smoothing_window",
    "stage_series",
]

LEGACY_EVAL_TASK = "eval"
"""Task name shown for the ``eval_<metric>`` records of runs older than per-task eval."""


PHASE_LABELS = {
    "wait_data": "wait",
    "forward": "fwd",
    "backward": "bwd",
    "optimizer": "opt",
    "weight_send": "send",
    "bookkeeping": "other",
}
"""The trainer's step phases (``time/<phase>_s`` in ``metrics.jsonl``, :mod:`trainer.observability.step_timing`)
in display order, with their short names; a phase not listed is shown under its own name, after these."""


class ReportError(ValueError):
    """The run directory cannot be reported on; the message names the file and the fix."""


@dataclass
class RunData:
    """What a report reads from one run directory (a missing optional file: empty, or None).

    Attributes:
        steps: training records of ``metrics.jsonl``, one per step (the last one written), sorted by ``step``.
        evals: task -> ``[(round, {metric: value})]`` sorted by round.
        packer_outcomes: ``rlbus_packer_groups_total`` by outcome from ``metrics_final/packer.prom``.
        skipped_lines: unparsable lines per file name.
    """

    run_dir: Path
    steps: list[dict]
    evals: dict[str, list[tuple[int, dict[str, float]]]]
    stages: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    accounting: dict | None = None
    packer_outcomes: dict[str, float] = field(default_factory=dict)
    startup: dict | None = None
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
            task, metric = key[len("eval/") :].split("/", 1)
            tasks.setdefault(task, {})[metric] = value
        elif key.startswith("eval_"):
            tasks.setdefault(LEGACY_EVAL_TASK, {})[key[len("eval_") :]] = value
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
    """Read a run directory.

    Raises:
        ReportError: no such directory; ``metrics.jsonl`` missing, empty, or without a training record.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"no run directory {run_dir}; give the run_dir of a run (e.g. runs/reverse_text)")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(
            f"{path} does not exist: the run has not trained a step yet (the trainer writes it after each step)"
        )
    skipped: dict[str, int] = {}
    records = _read_jsonl(path, skipped)
    if not records:
        raise ReportError(f"{path} is empty: the run has not trained a step yet")
    steps: dict[int, dict] = {}
    evals: dict[str, dict[int, dict[str, float]]] = {}
    eval_path = run_dir / EVAL_FILE
    eval_records = _read_jsonl(eval_path, skipped) if eval_path.is_file() else []
    for source, r in [*((path.name, r) for r in records), *((EVAL_FILE, r) for r in eval_records)]:
        if not isinstance(r.get("step"), int):
            skipped[source] = skipped.get(source, 0) + 1
            continue
        entries = _eval_entries(r)  # eval.jsonl's; in metrics.jsonl only before the packer kept its own file
        if entries:
            for task, metrics in entries.items():
                evals.setdefault(task, {})[r["step"]] = metrics
        else:
            steps[r["step"]] = r  # a step written twice (resume): the last record wins
    if not steps:
        raise ReportError(f"{path} holds no training step records: nothing to report yet")
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
        run.startup = json.loads((run_dir / "startup.json").read_text())
    except (OSError, ValueError):
        run.startup = None
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


def phase_series(run: RunData) -> dict[str, tuple[list[int], list[float]]]:
    """``{phase: (steps, seconds)}`` of the trainer's ``time/<phase>_s`` keys (phases in
    :data:`PHASE_LABELS` order, then by name); empty for runs without them."""
    names = {k[len("time/") : -len("_s")] for k in run.keys() if k.startswith("time/") and k.endswith("_s")}
    order = [p for p in PHASE_LABELS if p in names] + sorted(names - set(PHASE_LABELS))
    return {p: run.series(f"time/{p}_s") for p in order}


def phase_table(run: RunData) -> list[tuple[str, float, float, float]]:
    """Per phase: ``(phase, mean seconds per step, share, median seconds per step)`` over the steps that report
    every phase; share = the phase's total seconds / the steps' total ``step_time_s`` (or, without it, the phases'
    total), so the means add up to the mean step time and the shares to 1. Empty for runs without phase times."""
    phases = phase_series(run)
    if not phases:
        return []
    keys = [f"time/{p}_s" for p in phases]
    rows = [r for r in run.steps if all(isinstance(r.get(k), (int, float)) for k in keys)]
    if not rows:
        return []
    wall = sum(
        float(r["step_time_s"]) if isinstance(r.get("step_time_s"), (int, float)) else sum(r[k] for k in keys)
        for r in rows
    )
    out = []
    for phase, key in zip(phases, keys):
        values = [float(r[key]) for r in rows]
        share = sum(values) / wall if wall > 0 else math.nan
        out.append((phase, sum(values) / len(values), share, statistics.median(values)))
    return out
