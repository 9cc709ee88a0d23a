"""The packer's logic, socket-free (:mod:`packer.proc` moves the messages): the staleness filter
(a sample packed into step ``s`` has lag ``s - version_start``; a group over
``max_off_policy_steps`` is dropped and reported, so the prompt source replaces it), the content
filters, and whole steps of ``prompts_per_step`` groups in arrival order, packed without padding by
:mod:`packer.assemble` (one temperature per micro-batch; teacher logprobs all or nothing). Every
group id gets at most one decision in the run (docs/ARCHITECTURE.md, "Pace, staleness and
accounting"; temperature bins, teacher and masked samples: "Packer and trainer side").
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum
from typing import Literal

import numpy as np

from bus.messages import MicroBatch, ScoredGroup
from packer.assemble import has_teacher_logprobs, pack_groups

__all__ = [
    "DUPLICATE",
    "DropReason",
    "Packer",
    "has_teacher_logprobs",
    "padding_ratio",
    "rewards_all_equal",
    "rewards_all_zero_or_all_one",
]


class DropReason(StrEnum):
    """Why :class:`Packer` drops a group: the ``reason`` of its ``groups.dropped`` (``filtered: ...``
    counts as filtered in the ledger) and an ``outcome`` label of ``rlbus_packer_groups_total``."""

    EMPTY_PROMPT = "empty_prompt"
    TOO_LONG = "too_long"
    """A sample exceeds the micro-batch budget."""
    NO_TEACHER = "no_teacher"
    """With ``teacher``, the group has no teacher logprobs."""
    FILTERED_EQUAL_REWARDS = "filtered: equal_rewards"
    FILTERED_ONLINE_DIFFICULTY = "filtered: online_difficulty"
    STALE = "stale"
    """Its lag would exceed ``max_off_policy_steps`` at the next step."""


DUPLICATE = "duplicate"
""":meth:`Packer.add`'s answer for an id seen before: not a drop (no second outcome)."""


def rewards_all_equal(rewards: np.ndarray) -> bool:
    """True if every reward of ``[G] float32`` equals the first (G <= 1 too): every advantage is then 0."""
    return bool(np.all(rewards == rewards[0])) if len(rewards) else True


def rewards_all_zero_or_all_one(rewards: np.ndarray) -> bool:
    """True if the rewards ``[G] float32`` are all exactly 0 or all 1 (or none): no learning signal
    (Surogate's ``online_difficulty_filtering``; DAPO's dynamic sampling, Yu et al. 2025, arXiv:2503.14476)."""
    return bool(np.all(rewards == 0.0) or np.all(rewards == 1.0))


class Packer:
    """Buffers scored groups and emits whole optimizer steps as packed micro-batches.

    Args:
        prompts_per_step: groups per optimizer step (``batch_size / group_size``).
        max_off_policy_steps: largest lag a trained sample may have.
        micro_batch_tokens: token budget of one micro-batch.
        first_step: step index of the first step to emit (for resumed runs).
        filter_equal_rewards: drop groups with all rewards equal (:func:`rewards_all_equal`).
        online_difficulty_filtering: drop groups with rewards all 0 or all 1.
        teacher: pack teacher logprobs and drop groups without them (``teacher.model_path`` set).

    Raises:
        ValueError: a bound is not positive.
    """

    def __init__(
        self,
        prompts_per_step: int,
        max_off_policy_steps: int,
        micro_batch_tokens: int,
        first_step: int = 0,
        *,
        filter_equal_rewards: bool = False,
        online_difficulty_filtering: bool = False,
        teacher: bool = False,
    ) -> None:
        if prompts_per_step < 1 or micro_batch_tokens < 1 or max_off_policy_steps < 0:
            raise ValueError("prompts_per_step and micro_batch_tokens must be >= 1, max_off_policy_steps >= 0")
        self.prompts_per_step = prompts_per_step
        self.max_off_policy_steps = max_off_policy_steps
        self.micro_batch_tokens = micro_batch_tokens
        self.filter_equal_rewards = filter_equal_rewards
        self.online_difficulty_filtering = online_difficulty_filtering
        self.teacher = teacher
        self.next_step = first_step
        self.buffer: deque[ScoredGroup] = deque()
        self.seen: set[str] = set()  # every group id ever decided on (the whole run)
        self.last_groups: list[ScoredGroup] = []
        """The groups of the step :meth:`pop_step` last emitted, in packing order."""

    def lag(self, group: ScoredGroup, step: int) -> int:
        """Off-policy lag of ``group`` if trained at ``step``: ``step - min(version_start)``."""
        return step - int(np.min(group.version_start))

    def add(self, group: ScoredGroup) -> tuple[bool, DropReason | Literal["", "duplicate"]]:
        """Take a scored group: ``(accepted, reason)``, reason ``""``, :data:`DUPLICATE` or a
        :class:`DropReason` (content checks first, staleness last). ValueError for an eval group."""
        if group.is_eval:
            raise ValueError(
                f"group {group.id} is an eval group (eval_round {group.eval_round}); eval groups are never trained"
            )
        if group.id in self.seen:
            return False, DUPLICATE
        self.seen.add(group.id)
        if len(group.prompt_ids) == 0:
            return False, DropReason.EMPTY_PROMPT
        if int(len(group.prompt_ids) + group.completion_lens.max()) > self.micro_batch_tokens:
            return False, DropReason.TOO_LONG
        if self.teacher and not has_teacher_logprobs(group):
            return False, DropReason.NO_TEACHER
        if self.filter_equal_rewards and rewards_all_equal(group.rewards):
            return False, DropReason.FILTERED_EQUAL_REWARDS
        if self.online_difficulty_filtering and rewards_all_zero_or_all_one(group.rewards):
            return False, DropReason.FILTERED_ONLINE_DIFFICULTY
        if self.lag(group, self.next_step) > self.max_off_policy_steps:
            return False, DropReason.STALE
        self.buffer.append(group)
        return True, ""

    def pop_step(self) -> tuple[list[MicroBatch], list[ScoredGroup]]:
        """``(micro_batches, dropped)``: the next step's micro-batches if enough fresh groups are
        buffered (else ``[]``), and the buffered groups dropped as stale."""
        dropped = [g for g in self.buffer if self.lag(g, self.next_step) > self.max_off_policy_steps]
        if dropped:
            self.buffer = deque(g for g in self.buffer if g not in dropped)
        if len(self.buffer) < self.prompts_per_step:
            return [], dropped
        groups = [self.buffer.popleft() for _ in range(self.prompts_per_step)]
        self.last_groups = groups
        step = self.next_step
        self.next_step += 1
        return self.pack(groups, step), dropped

    def pack(self, groups: list[ScoredGroup], step: int) -> list[MicroBatch]:
        """The micro-batches of ``step`` made of ``groups``, a pure function of them and the settings
        (:func:`packer.assemble.pack_groups`), so a restarted packer re-emits a step identically."""
        return pack_groups(groups, step, self.micro_batch_tokens, teacher=self.teacher)

    def restore(self, *, next_step: int, seen: set[str], buffer: list[ScoredGroup]) -> None:
        """Take the state rebuilt from the spool (:mod:`packer.spool`). ValueError for ``next_step < 0``."""
        if next_step < 0:
            raise ValueError(f"next_step must be >= 0, got {next_step}")
        self.next_step = next_step
        self.seen |= seen
        self.buffer = deque(buffer)


def padding_ratio(micro_batches: list[MicroBatch], micro_batch_tokens: int) -> float:
    """Unused share of a step's token budget, ``1 - T / (M * micro_batch_tokens)`` for ``T`` tokens in
    ``M`` micro-batches (0.0 for none). ValueError for ``micro_batch_tokens < 1``."""
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    if not micro_batches:
        return 0.0
    tokens = sum(len(mb.input_ids) for mb in micro_batches)
    return 1.0 - tokens / (len(micro_batches) * micro_batch_tokens)
