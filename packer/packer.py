"""The packer's logic: staleness filter, whole-step accounting and padding-free packing.

The trainer takes optimizer step ``s`` with weights of policy version ``s`` (one version per
step), so a sample packed into step ``s`` has off-policy lag ``s - v`` where ``v`` is the oldest
policy version it was sampled under (``version_start``). :class:`Packer` drops every group whose
lag would exceed ``max_off_policy_steps`` (invariant 3) and reports it, so that the prompt source
can issue a replacement and every prompt is accounted for. A step takes ``prompts_per_step``
whole groups (``batch_size`` samples) in arrival order; its samples are packed into micro-batches
of at most ``micro_batch_tokens`` tokens, with no padding, each group that fits kept whole: planned
from the samples' lengths, then filled straight from the groups' arrays (:mod:`packer.assemble`).

Temperature bins: every sample records the temperature it was sampled at (``Prompt.temperature``,
e.g. from a ``sampling.temp_scheduler``), and the trainer divides the logits of a whole
micro-batch by ONE temperature (``MicroBatch.temperature``). So a step's samples are grouped by
temperature and each bin is packed separately; the step's micro-batches are the union (lowest
temperature first), and ``step_loss_tokens`` / ``step_samples`` still count the whole step.

Per-sample fields carried to the trainer: teacher logprobs (``RolloutGroup.teacher_logprobs``, on
the completion tokens, 0 elsewhere), the reward function scores (``ScoredGroup.reward_terms``),
and the loss mask: a sample with ``ScoredGroup.masked[j]`` (flagged by an enforced filter) keeps
its tokens in the row but gets ``loss_mask`` False everywhere, so it trains nothing and counts in
neither ``step_loss_tokens`` nor ``step_samples``.

Teacher logprobs are all or nothing within a micro-batch (a loss term cannot be half defined).
With ``teacher=True`` (``teacher.model_path`` set) a group that arrives without them (a producer
whose teacher failed, or one started without a teacher) is dropped with reason ``"no_teacher"``,
like any other drop: the prompt source issues a replacement, so the step still trains the
distillation term on every sample. With ``teacher=False`` teacher logprobs are never packed.

Every group id gets at most one decision for the whole run: taken into the buffer (and later
emitted or dropped stale), or dropped at once with a reason (``"empty_prompt"``, ``"too_long"``,
``"no_teacher"``, ``"filtered: equal_rewards"``, ``"filtered: online_difficulty"``, ``"stale"``).
Eval groups (``is_eval``) never come here: :mod:`packer.evaluation` aggregates them. Delivery is at-least-once, so the same group can
arrive again at any later time (re-sent by a reward worker, or scored twice by two workers); the
seen-id set therefore covers the whole run, never trimmed, so no group trains twice and no group
gets two outcomes. Its size is bounded by the run's prompt count (one short string per issued
prompt: ~100 bytes each, ~100 MB per million prompts).

No sockets here: :mod:`packer.proc` moves the messages.
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
    """Every reason :meth:`Packer.add` or :meth:`Packer.pop_step` drops a group for (see the module
    docstring). The value is the ``reason`` of the ``groups.dropped`` it is announced in (the prompt
    source's ledger counts ``filtered: ...`` as filtered, :func:`prompts.accounting.outcome_of_drop`)
    and an ``outcome`` label of ``rlbus_packer_groups_total``."""

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
"""What :meth:`Packer.add` answers for a group id it has seen before: not a drop (the group already
has its decision, so it gets no second outcome and no ``groups.dropped``)."""


def rewards_all_equal(rewards: np.ndarray) -> bool:
    """True if every reward of a group (``[G] float32``) equals the first (exactly; G=1 counts as
    equal): the group-relative advantage ``r - mean(r)`` is then 0 for every sample."""
    return bool(np.all(rewards == rewards[0])) if len(rewards) else True


def rewards_all_zero_or_all_one(rewards: np.ndarray) -> bool:
    """True if a group's rewards (``[G] float32``) are all exactly 0 or all exactly 1: the task
    is too hard or too easy for the policy and the group carries no learning signal (Surogate's
    ``online_difficulty_filtering``; the same idea as DAPO's dynamic sampling, Yu et al. 2025,
    arXiv:2503.14476). An empty group counts as such."""
    return bool(np.all(rewards == 0.0) or np.all(rewards == 1.0))


class Packer:
    """Buffers scored groups and emits whole optimizer steps as packed micro-batches.

    Args:
        prompts_per_step: groups per optimizer step (``batch_size / group_size``).
        max_off_policy_steps: largest lag a trained sample may have.
        micro_batch_tokens: token budget of one micro-batch.
        first_step: step index of the first step to emit (for resumed runs).
        filter_equal_rewards: drop groups whose rewards are all equal (reason
            ``"filtered: equal_rewards"``): their advantages are all zero, so they carry no policy
            gradient (DAPO's dynamic sampling, Yu et al. 2025, arXiv:2503.14476).
        online_difficulty_filtering: drop groups whose rewards are all 0 or all 1 (reason
            ``"filtered: online_difficulty"``, see :func:`rewards_all_zero_or_all_one`).
        teacher: the run has a teacher (``teacher.model_path``): pack teacher logprobs and drop
            groups without them (reason ``"no_teacher"``, see the module docstring).

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
        self.seen: set[str] = set()  # every group id ever decided on (whole run; see module docstring)
        self.last_groups: list[ScoredGroup] = []
        """The groups of the step :meth:`pop_step` last emitted, in packing order."""

    def lag(self, group: ScoredGroup, step: int) -> int:
        """Off-policy lag of ``group`` if trained at ``step``: ``step - min(version_start)``."""
        return step - int(np.min(group.version_start))

    def add(self, group: ScoredGroup) -> tuple[bool, DropReason | Literal["", "duplicate"]]:
        """Take a scored group.

        Checks run in this order: content first (the verdict cannot change), timing last.

        Returns:
            ``(accepted, reason)``; reason is ``""`` (accepted), :data:`DUPLICATE` (id seen before
            in this run: drop silently, it already has its decision), or a :class:`DropReason`.

        Raises:
            ValueError: an eval group (those go to :class:`packer.evaluation.EvalAggregator`).
        """
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
        """Emit the next step if enough fresh groups are buffered.

        Returns:
            ``(micro_batches, dropped)``: the step's micro-batches (empty if not ready yet) and
            the buffered groups dropped as stale while assembling it.
        """
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
        """The micro-batches of ``step`` made of ``groups`` (in this order): a pure function of
        its arguments and the packer's settings, so a restarted packer re-emits a planned step
        identically (same ids and contents, :mod:`packer.spool`). Each micro-batch is filled
        straight from the groups' arrays (:func:`packer.assemble.pack_groups`)."""
        return pack_groups(groups, step, self.micro_batch_tokens, teacher=self.teacher)

    def restore(self, *, next_step: int, seen: set[str], buffer: list[ScoredGroup]) -> None:
        """Take the state a restarted packer rebuilt from its spool: number steps from
        ``next_step``, treat ``seen`` ids as decided, and buffer ``buffer`` (in order).

        Raises:
            ValueError: ``next_step < 0``.
        """
        if next_step < 0:
            raise ValueError(f"next_step must be >= 0, got {next_step}")
        self.next_step = next_step
        self.seen |= seen
        self.buffer = deque(buffer)


def padding_ratio(micro_batches: list[MicroBatch], micro_batch_tokens: int) -> float:
    """Unused share of a step's token budget: ``1 - T / (M * micro_batch_tokens)``, where ``T``
    is the tokens of the ``M`` micro-batches (each a padding-free row of at most
    ``micro_batch_tokens``). 0 for a perfect packing; 0.0 for no micro-batches.

    Raises:
        ValueError: ``micro_batch_tokens < 1``.
    """
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    if not micro_batches:
        return 0.0
    tokens = sum(len(mb.input_ids) for mb in micro_batches)
    return 1.0 - tokens / (len(micro_batches) * micro_batch_tokens)
