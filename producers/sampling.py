"""Sampling parameters of the rollout producers: the per-prompt vLLM request parameters.

Temperature: the prompt source stamps it on each :class:`bus.messages.Prompt`
(:mod:`prompts.temperature`); the producer samples with it, the group records it and the trainer
divides its logits by it (vLLM's processed logprobs are post-temperature).

Request parameters (:func:`request_kwargs`): ``top_p``, ``min_tokens``, ``repetition_penalty``
from ``sampling``; ``seed = sampling.seed + prompt.index * n`` when ``sampling.seed`` is set: vLLM
seeds sample ``j`` of a request with ``seed + j`` (``vllm/v1/engine/parallel_sampling.py``), so
a group is reproducible whatever the batching, and the stride ``n`` keeps the ``n`` seeds of
one group apart from every other group's (``seed + index`` would give sample ``j`` of prompt ``i``
the random stream of sample ``j - 1`` of prompt ``i + 1``); eval prompts sample ``rollouts_per_example`` completions of at most
``eval.max_tokens or sampling.max_tokens`` tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bus.messages import Prompt
    from configs.schema import RunConfig


def request_kwargs(cfg: "RunConfig", prompt: "Prompt") -> dict[str, Any]:
    """Keyword arguments of :meth:`producers.engine.RolloutEngine.generate_group` for ``prompt``.

    Returns:
        ``{"n", "temperature", "top_p", "max_tokens", "min_tokens", "repetition_penalty",
        "seed"}``: ``n`` is ``producers.group_size`` for a training prompt and the eval task's
        ``rollouts_per_example`` for an eval prompt (``tasks.registry.eval_tasks``; 1 for a task
        not among them);
        ``temperature`` is ``prompt.temperature``; ``seed`` is ``None`` or
        ``sampling.seed + prompt.index * n``. ``min_tokens`` is capped at ``max_tokens`` (an eval
        ``max_tokens`` may be shorter).
    """
    sampling = cfg.sampling
    if prompt.is_eval:
        from tasks.registry import eval_tasks

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
