"""Micro-batch assembly, the one path from scored groups to micro-batches: :func:`plan_step` plans a
step from the samples' lengths, :func:`fill_step` fills each :class:`bus.messages.MicroBatch`'s
arrays straight from the groups' arrays by slice assignment (no per-sample copy). The result is a
pure function of the groups, the step and the budget, so a restarted packer re-emits a planned step
identically. Docs: docs/ARCHITECTURE.md ("Trainer math", Packing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bus.messages import MicroBatch, ScoredGroup
from bus.sample_arrays import sample_token_versions
from packer.packing import pack_micro_batches

__all__ = [
    "GroupLayout",
    "SampleRef",
    "fill_micro_batch",
    "fill_step",
    "has_teacher_logprobs",
    "pack_groups",
    "plan_step",
    "step_loss_counts",
]

SampleRef = tuple[int, int]
"""``(g, j)``: sample ``j`` of the step's group ``g`` (indices into the step's group list)."""


def has_teacher_logprobs(group: ScoredGroup) -> bool:
    """Whether ``group`` carries one teacher logprob per completion token."""
    return len(group.teacher_logprobs) == len(group.completion_ids)


def plan_step(
    lengths: Sequence[Sequence[int]], temperatures: Sequence[Sequence[float]], micro_batch_tokens: int
) -> list[list[SampleRef]]:
    """A step's micro-batches as lists of ``(g, j)`` (every sample once), one temperature each, from
    ``lengths[g][j]`` (ints >= 1) and ``temperatures[g][j]``: binned by temperature (ascending), a
    group's samples one unit (adjacent, so the trainer runs their prompt once) when they fit
    ``micro_batch_tokens``, else one unit each, packed by :func:`packer.packing.pack_micro_batches`.
    ValueError if the shapes differ, or as that function."""
    if len(lengths) != len(temperatures) or any(len(n) != len(t) for n, t in zip(lengths, temperatures)):
        raise ValueError("lengths and temperatures must have one entry per sample of each group (same shape)")
    plan: list[list[SampleRef]] = []
    for temperature in sorted({t for ts in temperatures for t in ts}):
        units: list[list[SampleRef]] = []
        for g, ts in enumerate(temperatures):
            refs = [(g, j) for j, t in enumerate(ts) if t == temperature]
            if not refs:
                continue
            if sum(lengths[g][j] for _, j in refs) <= micro_batch_tokens:
                units.append(refs)
            else:
                units += [[ref] for ref in refs]
        unit_tokens = [sum(int(lengths[g][j]) for g, j in unit) for unit in units]
        plan += [[ref for u in idx for ref in units[u]] for idx in pack_micro_batches(unit_tokens, micro_batch_tokens)]
    return plan


@dataclass(frozen=True)
class GroupLayout:
    """Sample ``j``'s completion tokens are ``offsets[j]:offsets[j + 1]`` (``[G + 1] int64``)."""

    offsets: np.ndarray

    @classmethod
    def of(cls, group: ScoredGroup) -> GroupLayout:
        """The layout of ``group``."""
        return cls(offsets=np.concatenate([[0], np.cumsum(group.completion_lens, dtype=np.int64)]))


def _is_masked(group: ScoredGroup, j: int) -> bool:
    """Whether sample ``j`` was masked by an enforced filter."""
    return len(group.masked) > 0 and bool(group.masked[j])


def _loss_tokens(group: ScoredGroup, layout: GroupLayout, j: int) -> int:
    """Loss tokens of sample ``j``: its model-sampled completion tokens, 0 when masked."""
    if _is_masked(group, j):
        return 0
    if len(group.loss_mask) == 0:
        return int(group.completion_lens[j])
    return int(np.count_nonzero(group.loss_mask[layout.offsets[j] : layout.offsets[j + 1]]))


def step_loss_counts(groups: Sequence[ScoredGroup], layouts: Sequence[GroupLayout] | None = None) -> tuple[int, int]:
    """``(step_loss_tokens, step_samples)``: the loss tokens of all of ``groups``' samples, and the
    samples with one or more (the trainer's normalizers); ``layouts``: the groups' layouts, if made."""
    tokens = samples = 0
    layouts = layouts if layouts is not None else [GroupLayout.of(g) for g in groups]
    for group, layout in zip(groups, layouts):
        for j in range(group.group_size):
            n = _loss_tokens(group, layout, j)
            tokens += n
            samples += n > 0
    return tokens, samples


def fill_micro_batch(
    groups: Sequence[ScoredGroup],
    refs: Sequence[SampleRef],
    *,
    teacher: bool,
    step: int,
    micro_index: int,
    num_micro_batches: int,
    step_loss_tokens: int,
    step_samples: int,
    layouts: Sequence[GroupLayout] | None = None,
) -> MicroBatch:
    """One padding-free :class:`MicroBatch` of the samples ``refs`` (``(g, j)`` in row order) of ``groups``.

    Sample ``(g, j)`` is its prompt (no loss, logprobs 0, version ``version_start[j]``) then its
    completion (ids, sampler and teacher logprobs, per-token versions, loss mask: the group's
    ``loss_mask`` there, all False when ``masked[j]``), its advantage on every token;
    ``reward_terms`` keeps the names every sample's group has. ``teacher``: pack teacher logprobs
    (else ``[0]``); the counts are the whole step's (:func:`step_loss_counts`).

    Raises:
        ValueError: no samples, two temperatures, or ``teacher`` and a group without teacher logprobs.
    """
    if not refs:
        raise ValueError("a micro-batch needs at least one sample")
    used = sorted({g for g, _ in refs})
    temperatures = {float(groups[g].temperature) for g in used}
    if len(temperatures) > 1:
        raise ValueError(
            f"samples of one micro-batch must share a temperature, got {sorted(temperatures)}; "
            "pack each temperature separately"
        )
    if teacher and (missing := [groups[g].id for g in used if not has_teacher_logprobs(groups[g])]):
        raise ValueError(f"groups {missing} carry no teacher logprobs; drop them (reason 'no_teacher') before packing")
    layouts = layouts if layouts is not None else [GroupLayout.of(g) for g in groups]
    seq_lens = np.array(
        [len(groups[g].prompt_ids) + int(groups[g].completion_lens[j]) for g, j in refs], dtype=np.int32
    )
    total = int(seq_lens.sum(dtype=np.int64))
    input_ids = np.empty(total, np.int32)
    loss_mask = np.zeros(total, bool)
    sampler_logprobs = np.zeros(total, np.float32)
    advantages = np.empty(total, np.float32)
    token_versions = np.empty(total, np.int64)
    teacher_logprobs = np.zeros(total if teacher else 0, np.float32)
    start = 0
    for (g, j), length in zip(refs, seq_lens.tolist()):
        group, layout = groups[g], layouts[g]
        lo, hi = int(layout.offsets[j]), int(layout.offsets[j + 1])
        mid, end = start + len(group.prompt_ids), start + length
        oldest = int(group.version_start[j])
        input_ids[start:mid] = group.prompt_ids
        input_ids[mid:end] = group.completion_ids[lo:hi]
        if not _is_masked(group, j):
            loss_mask[mid:end] = group.loss_mask[lo:hi] if len(group.loss_mask) else True
        sampler_logprobs[mid:end] = group.sampler_logprobs[lo:hi]
        advantages[start:end] = float(group.advantages[j])
        token_versions[start:mid] = oldest
        token_versions[mid:end] = sample_token_versions(group, j)
        if teacher:
            teacher_logprobs[mid:end] = group.teacher_logprobs[lo:hi]
        start = end
    names = set.intersection(*(set(groups[g].reward_terms) for g in used))
    return MicroBatch(
        id=f"{step}:{micro_index}",
        step=step,
        micro_index=micro_index,
        num_micro_batches=num_micro_batches,
        step_loss_tokens=step_loss_tokens,
        step_samples=step_samples,
        sample_ids=[f"{groups[g].id}/{j}" for g, j in refs],
        input_ids=input_ids,
        seq_lens=seq_lens,
        loss_mask=loss_mask,
        sampler_logprobs=sampler_logprobs,
        advantages=advantages,
        rewards=np.array([float(groups[g].rewards[j]) for g, j in refs], dtype=np.float32),
        oldest_versions=np.array([int(groups[g].version_start[j]) for g, j in refs], dtype=np.int64),
        token_versions=token_versions,
        teacher_logprobs=teacher_logprobs,
        temperature=temperatures.pop(),
        reward_terms={name: [float(groups[g].reward_terms[name][j]) for g, j in refs] for name in sorted(names)},
    )


def pack_groups(
    groups: Sequence[ScoredGroup], step: int, micro_batch_tokens: int, *, teacher: bool = False
) -> list[MicroBatch]:
    """The micro-batches of ``step`` made of ``groups`` (in this order): :func:`plan_step` on the
    samples' lengths, then :func:`fill_step`.

    Raises:
        ValueError: ``teacher`` and a group carries no teacher logprobs, or as :func:`plan_step`.
    """
    lengths = [[len(g.prompt_ids) + n for n in g.completion_lens.tolist()] for g in groups]
    temperatures = [[float(g.temperature)] * g.group_size for g in groups]
    return fill_step(groups, plan_step(lengths, temperatures, micro_batch_tokens), step, teacher=teacher)


def fill_step(
    groups: Sequence[ScoredGroup], plan: Sequence[Sequence[SampleRef]], step: int, *, teacher: bool = False
) -> list[MicroBatch]:
    """One micro-batch per entry of ``plan`` (the ``(g, j)`` of its samples, in row order), numbered
    in plan order; ``step_loss_tokens`` and ``step_samples`` count every sample of ``groups``.

    Raises:
        ValueError: ``teacher`` and a group carries no teacher logprobs, or as :func:`fill_micro_batch`.
    """
    if teacher and (missing := [g.id for g in groups if not has_teacher_logprobs(g)]):
        raise ValueError(f"groups {missing} carry no teacher logprobs; drop them (reason 'no_teacher') before packing")
    layouts = [GroupLayout.of(g) for g in groups]
    loss_tokens, loss_samples = step_loss_counts(groups, layouts)
    return [
        fill_micro_batch(
            groups,
            refs,
            teacher=teacher,
            step=step,
            micro_index=k,
            num_micro_batches=len(plan),
            step_loss_tokens=loss_tokens,
            step_samples=loss_samples,
            layouts=layouts,
        )
        for k, refs in enumerate(plan)
    ]
