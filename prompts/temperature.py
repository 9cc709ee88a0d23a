"""The sampling temperature each prompt carries, stamped by the prompt source.

Without ``sampling.temp_scheduler`` every training prompt is sampled at ``sampling.temperature``.
With one, the temperature of a prompt issued for optimizer step ``s`` interpolates from
``start_temperature`` (step 0) to ``end_temperature`` (step ``max_steps - 1``) with
``t = s / (max_steps - 1)`` (``t = 0`` when ``max_steps == 1``):

- linear: ``T(t) = start + (end - start) * t``;
- cosine (half period, as in cosine learning-rate decay, Loshchilov & Hutter 2017, SGDR eq. 5):
  ``T(t) = end + (start - end) * (1 + cos(pi * t)) / 2``.

A pure function of the step, so a re-issued prompt keeps its temperature. The producer samples
with the value on the prompt, the group records it and the trainer divides its logits by it
(vLLM's processed logprobs are post-temperature). Eval prompts use ``eval.temperature``, else the
temperature of the last step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from configs.schema import RunConfig, SamplingConfig


def temperature_at(sampling: "SamplingConfig", step: int, max_steps: int) -> float:
    """Sampling temperature of a prompt issued for optimizer ``step`` (formulas: module docstring).

    Args:
        sampling: the ``sampling`` config section.
        step: optimizer step, ``0 <= step``; steps past ``max_steps - 1`` get the end temperature.
        max_steps: steps of the run (``trainer.max_steps``), >= 1.

    Returns:
        The temperature (> 0, unitless).

    Raises:
        ValueError: ``step < 0`` or ``max_steps < 1``.
    """
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
    """Temperature of eval prompts: ``eval.temperature``, else the temperature of the last step."""
    if cfg.eval.temperature is not None:
        return float(cfg.eval.temperature)
    return temperature_at(cfg.sampling, cfg.trainer.max_steps - 1, cfg.trainer.max_steps)
