"""What the trainer reports after each optimizer step: :func:`report_step` sets the gauges, appends
the ``{"step": s + 1, **metrics}`` record to ``metrics.jsonl`` and logs one INFO line
(:func:`step_line`), so ``busctl logs RUN_DIR trainer`` shows the run step by step (one line)::

    step 12/200 loss 0.0123 reward 0.512 (std 0.21) kl 0.00120 entropy 0.84 grad_norm 0.33
    step 3.21 s (wait 0.10 s) lag 0.40 (max 1) 1234 tok/s

A key an option turns off is left out, a skipped step says so, non-finite values print as ``nan``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from runfiles.jsonl import append_jsonl
from trainer.observability.gauges import export_step_metrics

log = logging.getLogger("trainer.proc")
"""The trainer process's logger: the step lines sit with the rest of ``logs/trainer.log``."""

__all__ = ["report_step", "step_line"]


def _num(value: Any, digits: int) -> str:
    """``value`` with ``digits`` significant digits; ``nan``/``inf`` as such; ``?`` for a non-number."""
    if not isinstance(value, (int, float)):
        return "?"
    v = float(value)
    return str(v) if not math.isfinite(v) else f"{v:.{digits}g}"


def step_line(step: int, max_steps: int, metrics: dict[str, Any]) -> str:
    """The per-step log line (format in the module docstring).

    Args:
        step: optimizer steps done (the new policy version, 1-based).
        max_steps: ``trainer.max_steps``.
        metrics: the step's metrics (:meth:`trainer.trainer.Trainer.step` plus ``step_time_s``,
            ``time/wait_data_s``, ``policy_lag_mean``/``policy_lag_max`` in steps,
            ``tokens_per_s``); every key optional.

    Raises:
        ValueError: ``step`` is not in ``1..max_steps``.
    """
    if not 1 <= step <= max_steps:
        raise ValueError(f"step {step} is outside 1..trainer.max_steps ({max_steps})")
    parts = [f"step {step}/{max_steps}"]
    if metrics.get("skipped"):
        parts.append("SKIPPED (non-finite loss or gradient: no update)")
    for key, label, digits in (("loss", "loss", 4), ("reward_mean", "reward", 4)):
        if key in metrics:
            parts.append(f"{label} {_num(metrics[key], digits)}")
    if "reward_std" in metrics and "reward_mean" in metrics:
        parts[-1] += f" (std {_num(metrics['reward_std'], 3)})"
    for key, digits in (("kl", 3), ("entropy", 3), ("grad_norm", 3)):
        if key in metrics:
            parts.append(f"{key} {_num(metrics[key], digits)}")
    if "step_time_s" in metrics:
        wait = metrics.get("time/wait_data_s")
        parts.append(
            f"step {float(metrics['step_time_s']):.2f} s"
            + (f" (wait {float(wait):.2f} s)" if isinstance(wait, (int, float)) else "")
        )
    if "policy_lag_mean" in metrics:
        lag_max = metrics.get("policy_lag_max")
        parts.append(
            f"lag {float(metrics['policy_lag_mean']):.2f}"
            + (f" (max {int(lag_max)})" if isinstance(lag_max, (int, float)) and math.isfinite(lag_max) else "")
        )
    if "tokens_per_s" in metrics:
        parts.append(f"{_num(metrics['tokens_per_s'], 4)} tok/s")
    return " ".join(parts)


def report_step(step: int, max_steps: int, metrics: dict[str, Any], metrics_path: Path) -> None:
    """Gauges, the ``metrics.jsonl`` record ``{"step": step, **metrics}`` and the log line of
    one step (see the module docstring).

    Raises:
        KeyError: ``metrics`` has no ``step_time_s`` (:func:`export_step_metrics`).
        ValueError: ``step`` is not in ``1..max_steps``.
        OSError: metrics.jsonl cannot be written.
    """
    line = step_line(step, max_steps, metrics)
    export_step_metrics(step, metrics)
    append_jsonl(metrics_path, {"step": step, **metrics})
    log.info("%s", line)
