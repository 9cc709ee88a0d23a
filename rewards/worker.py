"""Reward/advantage workers: score a whole group, compute its group-relative advantages.

:class:`RewardWorker` is the socket-free logic (one :class:`bus.messages.RolloutGroup` in, one
:class:`bus.messages.ScoredGroup` out). :class:`RewardWorkerProc` is the process: it PULLs from
every producer's ``rollouts`` endpoint (fair-queued) and PUSHes to the packer's ``scored``
endpoint, so any number of workers can run side by side; one message is one whole group, so a
worker needs no state shared with the others.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
from prometheus_client import Counter, Histogram

from bus.component import Component, component_main
from bus.messages import RolloutGroup, RunDone, ScoredGroup
from rewards.advantages import group_advantages
from rewards.registry import get_reward_fn

log = logging.getLogger(__name__)

GROUPS_SCORED = Counter("rlbus_rewards_groups_total", "Groups scored")
REWARD = Histogram("rlbus_rewards_reward", "Reward per sample", buckets=[i / 10 for i in range(11)])
SCORE_SECONDS = Histogram("rlbus_rewards_score_seconds", "Time to score one group, seconds")
REWARD_ERRORS = Counter("rlbus_rewards_errors_total", "Reward function calls that raised (reward set to 0)", ["error"])


class RewardWorker:
    """Scores groups with one reward function and computes their advantages.

    Args:
        reward_fn_name: a name known to :func:`rewards.registry.get_reward_fn`.
        std_normalize, eps: see :func:`rewards.advantages.group_advantages`.
        name: this worker's name, recorded in each scored group.

    Raises:
        ValueError: unknown reward function.
    """

    def __init__(self, reward_fn_name: str, *, std_normalize: bool, eps: float, name: str) -> None:
        self.reward_fn = get_reward_fn(reward_fn_name)
        self.std_normalize = std_normalize
        self.eps = eps
        self.name = name

    def score(self, group: RolloutGroup) -> ScoredGroup:
        """Rewards ``[G] float32`` from the verifier and advantages ``[G] float32`` of one group."""
        rewards = np.array([self._reward(text, group.info) for text in group.completion_texts], dtype=np.float32)
        advantages = group_advantages(rewards, std_normalize=self.std_normalize, eps=self.eps)
        fields = {f.name: getattr(group, f.name) for f in dataclasses.fields(RolloutGroup)}
        return ScoredGroup(**fields, reward_worker=self.name, rewards=rewards, advantages=advantages.astype(np.float32))

    def _reward(self, completion: str, info: dict) -> float:
        """One verifier call; a verifier that raises scores 0 and is counted, never fatal."""
        try:
            reward = float(self.reward_fn(completion, info))
        except Exception as exc:
            REWARD_ERRORS.labels(type(exc).__name__).inc()
            log.warning("reward function raised %s: %s; reward set to 0", type(exc).__name__, exc)
            return 0.0
        return reward if np.isfinite(reward) else 0.0


class RewardWorkerProc(Component):
    """Process wrapper of :class:`RewardWorker` (PULL ``rollouts`` -> PUSH ``scored``)."""

    def setup(self) -> None:
        cfg = self.cfg
        self.worker = RewardWorker(
            cfg.rewards.reward_fn or cfg.task.name,
            std_normalize=cfg.rewards.std_normalize,
            eps=cfg.rewards.eps,
            name=self.name,
        )
        producers = [self.endpoints.address("rollouts", i) for i in range(cfg.producers.replicas)]
        self.rollouts = self.socket("rollouts", "recv", producers, bind=False, accept=(RolloutGroup,))
        self.scored = self.socket("scored", "send", self.endpoints.address("scored"), bind=False)
        self.control = self.control_subscriber()

    def run(self) -> None:
        while not self.stop.is_set():
            ctl = self.control.recv(timeout_s=0)
            if isinstance(ctl, RunDone):
                return
            group = self.rollouts.recv(timeout_s=0.2)
            if group is None:
                continue
            started = time.perf_counter()
            scored = self.worker.score(group)
            SCORE_SECONDS.observe(time.perf_counter() - started)
            for r in scored.rewards:
                REWARD.observe(float(r))
            GROUPS_SCORED.inc()
            self.scored.send(scored)


if __name__ == "__main__":
    raise SystemExit(component_main(RewardWorkerProc))
