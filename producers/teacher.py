"""Teacher logprobs for on-policy distillation: a second vLLM engine in the producer scores every
completion under a fixed teacher model.

For a prompt ``x`` and a completion ``y_1..y_L`` the teacher's per-token logprob is
``log p_teacher(y_t | x, y_<t)`` at temperature 1 (raw logits, no top-p), computed in one forward
pass as vLLM *prompt logprobs* of the sequence ``x + y`` (``SamplingParams(max_tokens=1,
prompt_logprobs=0)``; see :meth:`producers.engine.RolloutEngine.score_completion`). The trainer's
distillation term uses them as ``teacher_tau * (teacher_logprobs - train_logprobs)`` (on-policy distillation,
Agarwal et al. 2024, arXiv:2306.13649; the reverse-KL form of Gu et al. 2024, MiniLLM).

The teacher never changes: its engine takes no weight updates (its version stays 0) and has its
own KV cache (``teacher.kv_cache_gib``). It must share the policy's tokenizer, since it scores the
policy's token ids. Its ``max_model_len`` is the policy's + 1: a completion that filled the
policy's context is still scored (the scoring request samples one discarded token).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from configs.model_path import resolve_model_path
from producers.engine import RolloutEngine


class Teacher:
    """A teacher model on its own vLLM engine, scoring completions token by token.

    Args:
        model_path: HF model directory of the teacher (same tokenizer as the policy), or a hub id in
            the local HF cache (FileNotFoundError naming ``teacher.model_path`` if neither).
        max_model_len: the policy's ``max_model_len`` (tokens); the teacher's is one more.
        kv_cache_bytes: KV-cache size of the teacher engine, bytes.
        seed: engine seed (only the discarded scoring token is sampled).
        dtype: the engine's dtype, the producers' (``producers.dtype``; see
            :class:`producers.engine.RolloutEngine`): teacher logprobs then carry the same
            bfloat16 rounding as the sampler's.
    """

    def __init__(
        self, model_path: str | Path, *, max_model_len: int, kv_cache_bytes: int, seed: int = 0, dtype: str = "float32"
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
        )

    async def start(self) -> float:
        """Start the teacher engine; returns seconds."""
        return await self.engine.start()

    async def close(self) -> None:
        """Shut the teacher engine down (idempotent)."""
        await self.engine.close()

    async def score_group(self, prompt_ids: list[int], completions: list[list[int]], *, request_id: str) -> np.ndarray:
        """Teacher logprobs of every completion of a group, concatenated.

        Args:
            prompt_ids: ``[P]`` prompt token ids (chat template applied).
            completions: ``G`` lists of completion token ids (may be empty).
            request_id: prefix of the scoring requests' ids (unique among in-flight requests).

        Returns:
            ``[N] float32`` with ``N = sum(len(c) for c in completions)``: entry ``t`` of sample
            ``j``'s block is ``log p_teacher(c_j[t] | prompt, c_j[:t])``, nats.
        """
        scored = await asyncio.gather(
            *(
                self.engine.score_completion(prompt_ids, c, request_id=f"{request_id}-teacher-{j}")
                for j, c in enumerate(completions)
            )
        )
        flat = [lp for per_sample in scored for lp in per_sample]
        return np.asarray(flat, dtype=np.float32)
