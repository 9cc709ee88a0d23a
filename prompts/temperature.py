"""The sampling temperature each prompt carries: ``sampling.temperature``, or the
``sampling.temp_scheduler`` schedule over the steps, a pure function of the step (a re-issued
prompt keeps its temperature). The trainer divides its logits by the group's temperature.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from configs.schema import RunConfig, SamplingConfig


def temperature_at(sampling: "SamplingConfig", step: int, max_steps: int) -> float:
    """The temperature of a prompt of ``step``. With ``t = min(step / (max_steps - 1), 1)`` (0 when
    ``max_steps == 1``): linear ``start + (end - start) t``, cosine ``end + (start - end) (1 + cos(pi t))
    / 2`` (half period, SGDR eq. 5, Loshchilov & Hutter 2017). ValueError for ``step < 0``, ``max_steps < 1``."""
    if step < 0 or max_steps < 1:
        raise ValueError(f"need step >= 0 and max_steps >= 1, got step={step}, max_steps={max_steps}")
    sched = sampling.temp_scheduler
    if sched is None:
        return float(sampling.temperature)
    t = min(step / (max_steps - 1), 1.0) if max_steps > 1 else 0.0
    start, end = sched.start_temperature, sched.end_temperature
    if sched.type == "linear":
        return float(start + (end - start) * t)
    if sched.type == "cosine":
        return float(end + (start - end) * (1.0 + math.cos(math.pi * t)) / 2.0)
    raise ValueError(f"sampling.temp_scheduler.type={sched.type!r} is unknown; use linear or cosine")


def eval_temperature(cfg: "RunConfig") -> float:
    """``eval.temperature``, else the last step's temperature."""
    if cfg.eval.temperature is not None:
        return float(cfg.eval.temperature)
    return temperature_at(cfg.sampling, cfg.trainer.max_steps - 1, cfg.trainer.max_steps)
