"""The packer's logic: staleness filter, whole-step accounting and padding-free packing.

The trainer takes optimizer step ``s`` with weights of policy version ``s`` (one version per
step), so a sample packed into step ``s`` has off-policy lag ``s - v`` where ``v`` is the oldest
policy version it was sampled under (``version_start``). :class:`Packer` drops every group whose
lag would exceed ``max_off_policy_steps`` (invariant 3) and reports it, so that the prompt source
can issue a replacement and every prompt is accounted for. A step takes ``prompts_per_step``
whole groups (``batch_size`` samples) in arrival order; its samples are packed first-fit
decreasing into micro-batches of at most ``micro_batch_tokens`` tokens, with no padding.

Every group id gets at most one decision for the whole run: taken into the buffer (and later
emitted or dropped stale), or dropped at once with a reason (``"empty_prompt"``, ``"too_long"``,
``"filtered: equal_rewards"``, ``"stale"``). Delivery is at-least-once, so the same group can
arrive again at any later time (re-sent by a reward worker, or scored twice by two workers); the
seen-id set therefore covers the whole run, never trimmed, so no group trains twice and no group
gets two outcomes. Its size is bounded by the run's prompt count (one short string per issued
prompt: ~100 bytes each, ~100 MB per million prompts).

No sockets here: :mod:`packer.proc` moves the messages.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from bus.messages import MicroBatch, ScoredGroup
from packer.packing import pack_micro_batches


def rewards_all_equal(rewards: np.ndarray) -> bool:
    """True if every reward of a group (``[G] float32``) equals the first (exactly; G=1 counts as
    equal): the group-relative advantage ``r - mean(r)`` is then 0 for every sample."""
    return bool(np.all(rewards == rewards[0])) if len(rewards) else True


@dataclass(frozen=True)
class PackedSample:
    """One training sample: ``prompt + completion`` with per-token training fields.

    Attributes:
        sample_id: ``"{group_id}/{j}"``.
        input_ids: ``[L] int32``. loss_mask: ``[L] bool`` (completion tokens).
        inference_logprobs: ``[L] float32`` (0 on prompt tokens).
        advantage, reward: the sample's scalars. version: oldest policy version (lag source).
    """

    sample_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    inference_logprobs: np.ndarray
    advantage: float
    reward: float
    version: int


def group_samples(group: ScoredGroup) -> list[PackedSample]:
    """Split a scored group into its ``G`` training samples."""
    prompt = np.asarray(group.prompt_ids, dtype=np.int32)
    samples = []
    for j in range(group.group_size):
        ids, lps = group.completion(j)
        samples.append(
            PackedSample(
                sample_id=f"{group.id}/{j}",
                input_ids=np.concatenate([prompt, ids]).astype(np.int32),
                loss_mask=np.concatenate([np.zeros(len(prompt), bool), np.ones(len(ids), bool)]),
                inference_logprobs=np.concatenate([np.zeros(len(prompt), np.float32), lps]).astype(np.float32),
                advantage=float(group.advantages[j]),
                reward=float(group.rewards[j]),
                version=int(group.version_start[j]),
            )
        )
    return samples


def build_micro_batch(
    samples: list[PackedSample],
    *,
    step: int,
    micro_index: int,
    num_micro_batches: int,
    step_loss_tokens: int,
    step_samples: int,
) -> MicroBatch:
    """Concatenate ``samples`` into one padding-free :class:`MicroBatch` row.

    ``step_loss_tokens`` and ``step_samples`` (samples with >= 1 loss token) count the WHOLE step,
    so the trainer's loss normalizers do not depend on how the step was split (micro-batch
    invariance, see :mod:`trainer.loss`).
    """
    return MicroBatch(
        id=f"{step}:{micro_index}",
        step=step,
        micro_index=micro_index,
        num_micro_batches=num_micro_batches,
        step_loss_tokens=step_loss_tokens,
        step_samples=step_samples,
        sample_ids=[s.sample_id for s in samples],
        input_ids=np.concatenate([s.input_ids for s in samples]),
        seq_lens=np.array([len(s.input_ids) for s in samples], dtype=np.int32),
        loss_mask=np.concatenate([s.loss_mask for s in samples]),
        inference_logprobs=np.concatenate([s.inference_logprobs for s in samples]),
        advantages=np.concatenate([np.full(len(s.input_ids), s.advantage, np.float32) for s in samples]),
        rewards=np.array([s.reward for s in samples], dtype=np.float32),
        versions=np.array([s.version for s in samples], dtype=np.int64),
        teacher_logprobs=np.zeros(0, dtype=np.float32),
    )


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
    ) -> None:
        if prompts_per_step < 1 or micro_batch_tokens < 1 or max_off_policy_steps < 0:
            raise ValueError("prompts_per_step and micro_batch_tokens must be >= 1, max_off_policy_steps >= 0")
        self.prompts_per_step = prompts_per_step
        self.max_off_policy_steps = max_off_policy_steps
        self.micro_batch_tokens = micro_batch_tokens
        self.filter_equal_rewards = filter_equal_rewards
        self.next_step = first_step
        self.buffer: deque[ScoredGroup] = deque()
        self.seen: set[str] = set()  # every group id ever decided on (whole run; see module docstring)

    def lag(self, group: ScoredGroup, step: int) -> int:
        """Off-policy lag of ``group`` if trained at ``step``: ``step - min(version_start)``."""
        return step - int(np.min(group.version_start))

    def add(self, group: ScoredGroup) -> tuple[bool, str]:
        """Take a scored group.

        Checks run in this order: content first (the verdict cannot change), timing last.

        Returns:
            ``(accepted, reason)``; reason is ``""``, ``"duplicate"`` (id seen before in this
            run: drop silently, it already has its decision), ``"empty_prompt"``, ``"too_long"``
            (a sample exceeds the micro-batch budget), ``"filtered: equal_rewards"`` (with
            ``filter_equal_rewards``) or ``"stale"`` (lag above the bound at the next step).
        """
        if group.id in self.seen:
            return False, "duplicate"
        self.seen.add(group.id)
        if len(group.prompt_ids) == 0:
            return False, "empty_prompt"
        if int(len(group.prompt_ids) + group.completion_lens.max()) > self.micro_batch_tokens:
            return False, "too_long"
        if self.filter_equal_rewards and rewards_all_equal(group.rewards):
            return False, "filtered: equal_rewards"
        if self.lag(group, self.next_step) > self.max_off_policy_steps:
            return False, "stale"
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
        samples = [s for g in groups for s in group_samples(g)]
        bins = pack_micro_batches([len(s.input_ids) for s in samples], self.micro_batch_tokens)
        loss_tokens = int(sum(s.loss_mask.sum() for s in samples))
        loss_samples = sum(1 for s in samples if s.loss_mask.any())
        step = self.next_step
        self.next_step += 1
        batches = [
            build_micro_batch(
                [samples[i] for i in idx],
                step=step,
                micro_index=k,
                num_micro_batches=len(bins),
                step_loss_tokens=loss_tokens,
                step_samples=loss_samples,
            )
            for k, idx in enumerate(bins)
        ]
        return batches, dropped
