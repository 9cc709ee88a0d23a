"""Teacher logprobs for on-policy distillation: a second vLLM engine in the producer scores every completion.

``log p_teacher(y_t | x, y_<t)`` at temperature 1, as vLLM prompt logprobs of ``x + y`` in one forward
(:meth:`producers.engine.RolloutEngine.score_completion`); the trainer uses ``teacher_tau * (teacher_logprobs -
train_logprobs)`` (Agarwal et al. 2024, arXiv:2306.13649; reverse KL as in Gu et al. 2024, MiniLLM). The teacher
takes no weight updates, shares the policy's tokenizer, and has ``max_model_len`` + 1 so a full-context completion
is still scored.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from configs.model_path import resolve_model_path
from producers.engine import RolloutEngine


class Teacher:
    """A teacher model on its own vLLM engine in the producers' ``dtype``, scoring completions token by token.

    ``max_model_len``: the policy's. ``fork_engine_core``: as :class:`producers.engine.RolloutEngine`'s.
    ValueError: an empty ``model_path``; FileNotFoundError: not found.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_model_len: int,
        kv_cache_bytes: int,
        seed: int = 0,
        dtype: str = "float32",
        fork_engine_core: bool | None = None,
    ) -> None:
        if not str(model_path):
            raise ValueError("teacher model_path is empty")
        self.engine = RolloutEngine(
            resolve_model_path(model_path, key="teacher.model_path"),
            max_model_len=max_model_len + 1,
            kv_cache_bytes=kv_cache_bytes,
            seed=seed,
            warmup=False,
            dtype=dtype,
            engine_kwargs={"logprobs_mode": "raw_logprobs"},
            fork_engine_core=fork_engine_core,
        )

    async def start(self) -> float:
        """Start the teacher engine; returns seconds."""
        return await self.engine.start()

    async def close(self) -> None:
        """Shut the teacher engine down (idempotent)."""
        await self.engine.close()

    async def score_group(self, prompt_ids: list[int], completions: list[list[int]], *, request_id: str) -> np.ndarray:
        """``[N] float32`` teacher logprobs (nats) of the ``G`` completions concatenated, N = their total length.

        Entry ``t`` of sample ``j``'s block is ``log p_teacher(c_j[t] | prompt, c_j[:t])``.
        """
        scored = await asyncio.gather(
            *(
                self.engine.score_completion(prompt_ids, c, request_id=f"{request_id}-teacher-{j}")
                for j, c in enumerate(completions)
            )
        )
        flat = [lp for per_sample in scored for lp in per_sample]
        return np.asarray(flat, dtype=np.float32)
