"""Sampling parameters of the rollout producers: the temperature schedule and the per-prompt
vLLM request parameters.

Temperature. Without ``sampling.temp_scheduler`` every training prompt is sampled at
``sampling.temperature``. With one, the temperature of a prompt issued for optimizer step ``s``
interpolates from ``start_temperature`` (step 0) to ``end_temperature`` (step ``max_steps - 1``)
with ``t = s / (max_steps - 1)`` (``t = 0`` when ``max_steps == 1``):

- linear: ``T(t) = start + (end - start) * t``;
- cosine (half period, as in cosine learning-rate decay, Loshchilov & Hutter 2017, SGDR eq. 5):
  ``T(t) = end + (start - end) * (1 + cos(pi * t)) / 2``.

The prompt source stamps the value on each :class:`bus.messages.Prompt`; the producer samples with
it, the group records it and the trainer divides its logits by it (vLLM's processed logprobs are
post-temperature). Eval prompts use ``eval.temperature``, else the temperature of the last step.

Request parameters (:func:`request_kwargs`): ``top_p``, ``min_tokens``, ``repetition_penalty``
from ``sampling``; ``seed = sampling.seed + prompt.index * n`` when ``sampling.seed`` is set: vLLM
seeds sample ``j`` of a request with ``seed + j`` (``vllm/v1/engine/parallel_sampling.py``), so
a group is reproducible whatever the batching, and the stride ``n`` keeps the ``n`` seeds of
one group apart from every other group's (``seed + index`` would give sample ``j`` of prompt ``i``
the random stream of sample ``j - 1`` of prompt ``i + 1``); eval prompts sample ``rollouts_per_example`` completions of at most
``eval.max_tokens or sampling.max_tokens`` tokens.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bus.messages import Prompt
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


def request_kwargs(cfg: "RunConfig", prompt: "Prompt") -> dict[str, Any]:
    """Keyword arguments of :meth:`producers.engine.RolloutEngine.generate_group` for ``prompt``.

    Returns:
        ``{"n", "temperature", "top_p", "max_tokens", "min_tokens", "repetition_penalty",
        "seed"}``: ``n`` is ``producers.group_size`` for a training prompt and the eval task's
        ``rollouts_per_example`` for an eval prompt (``producers.tasks.eval_tasks``; 1 for a task
        not among them);
        ``temperature`` is ``prompt.temperature``; ``seed`` is ``None`` or
        ``sampling.seed + prompt.index * n``. ``min_tokens`` is capped at ``max_tokens`` (an eval
        ``max_tokens`` may be shorter).
    """
    sampling = cfg.sampling
    if prompt.is_eval:
        from producers.tasks import eval_tasks

        per_task = {t.name: t.rollouts_per_example for t in eval_tasks(cfg)}
        n = per_task.get(prompt.task, 1)
        max_tokens = cfg.eval.max_tokens or sampling.max_tokens
    else:
        n, max_tokens = cfg.producers.group_size, sampling.max_tokens
    return dict(
        n=n,
        temperature=float(prompt.temperature),
        top_p=sampling.top_p,
        max_tokens=max_tokens,
        min_tokens=min(sampling.min_tokens, max_tokens),
        repetition_penalty=sampling.repetition_penalty,
        seed=None if sampling.seed is None else sampling.seed + prompt.index * n,
    )
