"""The trainer's throughput, one function per figure, from its ``metrics.jsonl`` step records.

Two figures, each per second of step time (``step_time_s``: the wall time between step ends, waiting for data
included, so its sum is the training wall time): all tokens (``num_tokens``: prompt + completion tokens of the
step's samples) and loss tokens (``num_loss_tokens``: the completion tokens the loss covers). ``busctl status``,
``busctl report``'s summary and stage table, and its throughput plot all print these, so each meaning has one
number. The other stages' rates (``stages.jsonl``, ``status.json``) are completion tokens per second of wall time
from the metrics poller, a different figure, labelled as such.
"""

from __future__ import annotations

import math
from pathlib import Path

__all__ = ["ALL_TOKENS", "LOSS_TOKENS", "run_throughput_text", "step_rates", "throughput_text", "trainer_throughput"]

ALL_TOKENS = "all tokens/s"
"""Label of ``num_tokens`` (prompt + completion) per second of step time."""

LOSS_TOKENS = "loss tokens/s"
"""Label of ``num_loss_tokens`` per second of step time."""

_KEYS = {ALL_TOKENS: "num_tokens", LOSS_TOKENS: "num_loss_tokens"}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def trainer_throughput(steps: list[dict]) -> dict[str, float]:
    """``{ALL_TOKENS: x, LOSS_TOKENS: y, "steps": n}`` over the step records that carry the count and a positive
    ``step_time_s``: the summed tokens / the summed step time (a figure is absent when no record has its count)."""
    out: dict[str, float] = {}
    for label, key in _KEYS.items():
        rows = [r for r in steps if _number(r.get(key)) and _number(r.get("step_time_s")) and r["step_time_s"] > 0]
        if rows:
            out[label] = sum(r[key] for r in rows) / sum(r["step_time_s"] for r in rows)
            out["steps"] = max(out.get("steps", 0), len(rows))
    return out


def step_rates(steps: list[dict], label: str) -> tuple[list[int], list[float]]:
    """Per step, the figure ``label`` of that step alone: ``(steps, tokens / step_time_s)``."""
    key = _KEYS[label]
    rows = [r for r in steps if _number(r.get(key)) and _number(r.get("step_time_s")) and r["step_time_s"] > 0]
    return [int(r["step"]) for r in rows], [r[key] / r["step_time_s"] for r in rows]


def throughput_text(steps: list[dict]) -> str:
    """``trainer throughput over 300 steps: 4,903 all tokens/s, 1,502 loss tokens/s (per second of step time)``;
    ``trainer throughput: no step yet`` without figures."""
    t = trainer_throughput(steps)
    figures = [f"{t[label]:,.0f} {label}" for label in (ALL_TOKENS, LOSS_TOKENS) if label in t]
    if not figures:
        return "trainer throughput: no step yet"
    n = int(t["steps"])
    return f"trainer throughput over {n} step{'s' * (n != 1)}: {', '.join(figures)} (per second of step time)"


def run_throughput_text(run_dir: Path) -> str:
    """:func:`throughput_text` of the run directory's ``metrics.jsonl`` (read as ``busctl report`` reads it)."""
    from busctl.run_data import ReportError, load_run

    try:
        return throughput_text(load_run(run_dir).steps)
    except ReportError:
        return throughput_text([])
