"""Scored groups built by hand, and a step of them packed as the packer packs (packer.assemble), for
the tests of the packer, the trainer and the policies.

Default values are traceable: completion token ``t`` has sampler logprob ``-t / 1000``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bus.messages import MicroBatch, ScoredGroup
from packer.assemble import SampleRef, fill_step


def scored(
    gid: str,
    prompt_ids: Sequence[int],
    completions: Sequence[Sequence[int]],
    *,
    version: int | Sequence[int] = 0,
    advantages: Sequence[float] | None = None,
    rewards: Sequence[float] | None = None,
    logprobs: Sequence[Sequence[float]] | None = None,
    **fields,
) -> ScoredGroup:
    """A :class:`ScoredGroup` of ``len(completions)`` samples after ``prompt_ids``.

    ``version``: every sample's policy version (one for all, or one per sample); ``advantages``
    default 0, ``rewards`` 0.5; ``logprobs``: each completion's sampler logprobs (default
    ``-t / 1000`` per token ``t``); ``fields`` sets the optional ones (temperature,
    teacher_logprobs, masked, reward_terms, loss_mask, ...).
    """
    g = len(completions)
    versions = [version] * g if isinstance(version, int) else list(version)
    flat = [t for c in completions for t in c]
    lps = [x for c in logprobs for x in c] if logprobs is not None else [-t / 1000 for t in flat]
    return ScoredGroup(
        id=gid,
        prompt_index=0,
        step=0,
        task="reverse_text",
        info={"target": "x"},
        producer="p0",
        completion_texts=["c"] * g,
        finish_reasons=["stop"] * g,
        gen_time_s=0.0,
        prompt_ids=np.array(prompt_ids, np.int32),
        completion_ids=np.array(flat, np.int32),
        completion_lens=np.array([len(c) for c in completions], np.int32),
        sampler_logprobs=np.array(lps, np.float32),
        version_start=np.array(versions, np.int64),
        version_end=np.array(versions, np.int64),
        reward_worker="r0",
        rewards=np.array(rewards if rewards is not None else [0.5] * g, np.float32),
        advantages=np.array(advantages if advantages is not None else [0.0] * g, np.float32),
        **fields,
    )


def sample_refs(groups: Sequence[ScoredGroup]) -> list[SampleRef]:
    """``(g, j)`` of every sample of ``groups``, in group order: index ``i`` of a split is ``refs[i]``."""
    return [(g, j) for g, group in enumerate(groups) for j in range(group.group_size)]


def packed_step(
    groups: Sequence[ScoredGroup], split: Sequence[Sequence[int]] | None = None, *, step: int = 0, teacher: bool = False
) -> list[MicroBatch]:
    """Step ``step`` of ``groups`` as micro-batches through the packer's :func:`packer.assemble.fill_step`:
    one per entry of ``split`` (indices into :func:`sample_refs`; default: all in one)."""
    refs = sample_refs(groups)
    split = split if split is not None else [range(len(refs))]
    return fill_step(groups, [[refs[i] for i in idx] for idx in split], step, teacher=teacher)


def sample_tokens(group: ScoredGroup, j: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Sample ``j``'s ``prompt + completion`` ids ``[L] int32`` and loss mask ``[L] bool`` as the
    packer lays them out (single-turn: every completion token is a loss token)."""
    ids, _ = group.completion(j)
    tokens = np.concatenate([group.prompt_ids, ids]).astype(np.int32)
    return tokens, np.arange(len(tokens)) >= len(group.prompt_ids)
