"""The per-prompt vLLM request parameters of the rollout producers.

The temperature is the prompt's (stamped by :mod:`prompts.temperature`; vLLM's processed logprobs are
post-temperature, as the trainer computes them). ``seed = sampling.seed + prompt.index * n``: vLLM seeds sample
``j`` with ``seed + j`` (``vllm/v1/engine/parallel_sampling.py``), and the stride ``n`` keeps groups' streams
apart (``seed + index`` would give sample ``j`` of prompt ``i`` the stream of sample ``j - 1`` of prompt ``i + 1``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bus.messages import Prompt
    from configs.schema import RunConfig


def request_kwargs(cfg: "RunConfig", prompt: "Prompt") -> dict[str, Any]:
    """Keyword arguments of :meth:`producers.engine.RolloutEngine.generate_group` for ``prompt``.

    ``n``: ``producers.group_size``, or an eval task's ``rollouts_per_example`` (1 for an unknown task) with
    ``eval.max_tokens or sampling.max_tokens``; ``min_tokens`` capped at ``max_tokens``.
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
