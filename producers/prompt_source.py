"""The prompt source: issues the dataset's prompts onto ``prompts``, gated by the trainer's pace.

Each optimizer step consumes ``prompts_per_step`` groups. The k-th *counted* prompt belongs to
step ``s = k // prompts_per_step``, and it is issued only while
``policy_version >= s - max_async_level``, where ``policy_version`` is the version that every
producer runs: the minimum over the producers' ``weights.applied`` announcements (the trainer's
version as the producers see it). Gating on what the producers have *applied*, not on what the
trainer has announced, makes the async level a real bound: a prompt of step ``s`` is sampled
under a version ``>= s - max_async_level``, so its off-policy lag at step ``s`` is at most
``max_async_level``. A group the packer drops (e.g. stale) is announced on the control channel;
it no longer counts towards a step, so a replacement is issued for it. Issuing stops once the
prompts for the last step (``max_steps - 1``) are out.

:class:`PromptSource` is the socket-free logic; :class:`PromptSourceProc` the process.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import Counter, Gauge

from bus.component import Component, component_main
from bus.messages import GroupsDropped, Prompt, RunDone, WeightsApplied
from bus.metrics import POLICY_VERSION
from producers.tasks import load_task_examples, render_messages

log = logging.getLogger(__name__)

PROMPTS_ISSUED = Counter("rlbus_prompt_source_prompts_total", "Prompts issued")
PROMPTS_REPLACED = Counter("rlbus_prompt_source_replaced_total", "Prompts re-issued for dropped groups")
GATED = Gauge("rlbus_prompt_source_gated", "1 while issuing waits for the trainer (async level reached)")


class PromptSource:
    """Decides which prompt to issue next and when.

    Args:
        examples: task examples ``{"id", "prompt", "info"}`` (cycled when exhausted).
        task: task name stamped on each prompt.
        prompts_per_step: groups per optimizer step. max_async_level: see module docstring.
        max_steps: steps of the run; no prompt is issued for step >= max_steps.
        num_producers: producers whose applied version is tracked (the minimum gates).

    Raises:
        ValueError: no examples, or non-positive counts.
    """

    def __init__(
        self,
        examples: list[dict[str, Any]],
        *,
        task: str,
        prompts_per_step: int,
        max_async_level: int,
        max_steps: int,
        num_producers: int = 1,
    ) -> None:
        if not examples:
            raise ValueError("the task has no training examples")
        if prompts_per_step < 1 or max_steps < 1 or max_async_level < 0 or num_producers < 1:
            raise ValueError("prompts_per_step, max_steps and num_producers must be >= 1, max_async_level >= 0")
        self.examples = examples
        self.task = task
        self.prompts_per_step = prompts_per_step
        self.max_async_level = max_async_level
        self.max_steps = max_steps
        self.num_producers = num_producers
        self.applied: dict[str, int] = {}
        self.num_issued = 0
        self.num_dropped = 0

    @property
    def policy_version(self) -> int:
        """The version every producer runs: min of their applied versions (0 until all reported)."""
        if len(self.applied) < self.num_producers:
            return 0
        return min(self.applied.values())

    @property
    def next_step(self) -> int:
        """The step the next prompt would belong to."""
        return (self.num_issued - self.num_dropped) // self.prompts_per_step

    def may_issue(self) -> bool:
        """True if the next prompt's step is within the async level and the run."""
        step = self.next_step
        return step < self.max_steps and self.policy_version >= step - self.max_async_level

    def issue(self) -> Prompt:
        """Build the next prompt (call only when :meth:`may_issue`)."""
        assert self.may_issue()
        ex = self.examples[self.num_issued % len(self.examples)]
        prompt = Prompt(
            id=f"p{self.num_issued:08d}",
            index=self.num_issued,
            step=self.next_step,
            task=self.task,
            messages=render_messages(ex),
            info=dict(ex["info"]),
        )
        self.num_issued += 1
        return prompt

    def on_weights_applied(self, producer: str, version: int) -> None:
        """``producer`` now runs ``version`` (older announcements are ignored)."""
        self.applied[producer] = max(self.applied.get(producer, 0), version)

    def on_dropped(self, num_groups: int) -> None:
        """``num_groups`` issued prompts will never train: issue replacements."""
        self.num_dropped += num_groups


class PromptSourceProc(Component):
    """Process wrapper of :class:`PromptSource` (PUSH ``prompts``, bound; SUB control)."""

    def setup(self) -> None:
        cfg = self.cfg
        examples = load_task_examples(cfg.task.name, "train", cfg.task.num_train_examples, cfg.task.seed)
        self.source = PromptSource(
            examples,
            task=cfg.task.name,
            prompts_per_step=cfg.prompts_per_step,
            max_async_level=cfg.max_async_level,
            max_steps=cfg.trainer.max_steps,
            num_producers=cfg.producers.replicas,
        )
        self.prompts = self.socket("prompts", "send", self.endpoints.address("prompts"), bind=True)
        self.control = self.control_subscriber()
        self.pending: Prompt | None = None

    def _handle_control(self, timeout_s: float) -> bool:
        """Apply control messages; False once the run is done."""
        msg = self.control.recv(timeout_s=timeout_s)
        while msg is not None:
            if isinstance(msg, WeightsApplied):
                self.source.on_weights_applied(msg.producer, msg.version)
                POLICY_VERSION.set(self.source.policy_version)
            elif isinstance(msg, GroupsDropped):
                self.source.on_dropped(len(msg.group_ids))
                PROMPTS_REPLACED.inc(len(msg.group_ids))
            elif isinstance(msg, RunDone):
                return False
            msg = self.control.recv(timeout_s=0)
        return True

    def run(self) -> None:
        while not self.stop.is_set():
            if self.pending is None and self.source.may_issue():
                self.pending = self.source.issue()
            GATED.set(self.pending is None)
            if self.pending is None:
                if not self._handle_control(timeout_s=0.2):
                    return
                continue
            if self.prompts.send(self.pending, timeout_s=0.2):
                PROMPTS_ISSUED.inc()
                self.pending = None
            if not self._handle_control(timeout_s=0):
                return


if __name__ == "__main__":
    raise SystemExit(component_main(PromptSourceProc))
