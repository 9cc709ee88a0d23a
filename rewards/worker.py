"""Reward/advantage workers: score a whole group, compute its group-relative advantages.

:class:`RewardWorker` is the socket-free logic (one :class:`bus.messages.RolloutGroup` in, one
:class:`bus.messages.ScoredGroup` out). :class:`RewardWorkerProc` is the process: it receives from
every producer's ``rollouts`` endpoint (all ``producers.max_replicas`` of them, so producers added
later are reached) and sends to the packer's ``scored`` endpoint, so any number of workers can run
side by side; one message is one whole group, so a worker needs no state shared with the others.
Custody (:mod:`bus.reliable`): a rollout is released to its producer only once the packer is done
with its scored group; a worker killed at any moment loses nothing.

The reward function runs in child processes by default (``rewards.isolate``, see
:mod:`rewards.isolation`): one that raises, hangs past ``rewards.timeout_s``, crashes or returns NaN
scores that sample 0, counted in ``rlbus_rewards_errors_total{error=...}``, and the worker goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
from prometheus_client import Counter, Histogram

from bus.component import Component, component_main
from bus.messages import RolloutGroup, RunDone, ScoredGroup
from rewards.advantages import compute_advantages, resolve_advantage_fn
from rewards.isolation import InProcessScorer, IsolatedScorer

log = logging.getLogger(__name__)

GROUPS_SCORED = Counter("rlbus_rewards_groups_total", "Groups scored")
REWARD = Histogram("rlbus_rewards_reward", "Reward per sample", buckets=[i / 10 for i in range(11)])
SCORE_SECONDS = Histogram("rlbus_rewards_score_seconds", "Time to score one group, seconds")
REWARD_ERRORS = Counter(
    "rlbus_rewards_errors_total",
    "Reward function calls that failed (reward set to 0), by error: the exception type, timeout, crash or non_finite",
    ["error"],
)


class RewardWorker:
    """Scores groups with one reward function and computes their advantages.

    Args:
        reward_fn_name: a registry name or import path, see :func:`rewards.registry.get_reward_fn`.
        advantage: the advantage estimator, a built-in name or an import path
            ``"package.module:function"``, resolved once here (see
            :func:`rewards.advantages.resolve_advantage_fn`).
        eps: added to the std by ``"grpo"``, see :func:`rewards.advantages.compute_advantages`.
        name: this worker's name, recorded in each scored group.
        isolate: run the reward function in child processes (:class:`rewards.isolation.IsolatedScorer`;
            call :meth:`close`); False: in this process, without timeout or crash protection.
        timeout_s, num_procs: see :class:`rewards.isolation.IsolatedScorer` (``isolate`` only).

    Raises:
        ValueError: unknown reward function or advantage estimator, or an import path that does
            not import or is not callable.
    """

    def __init__(
        self,
        reward_fn_name: str,
        *,
        advantage: str = "grpo",
        eps: float = 1e-6,
        name: str,
        isolate: bool = True,
        timeout_s: float = 5.0,
        num_procs: int = 2,
    ) -> None:
        self.advantage = resolve_advantage_fn(advantage)  # before the scorer: fail fast, no children left
        self.scorer: InProcessScorer | IsolatedScorer = (
            IsolatedScorer(reward_fn_name, timeout_s=timeout_s, num_procs=num_procs) if isolate else InProcessScorer(reward_fn_name)
        )
        self.eps = eps
        self.name = name

    def score(self, group: RolloutGroup) -> ScoredGroup:
        """Rewards ``[G] float32`` from the verifier and advantages ``[G] float32`` of one group.

        A sample whose reward call failed scores 0 and is counted by error label; never raises for it.

        Raises:
            ValueError: a custom advantage function returned a wrong shape or non-finite values (a
                bug in that function, not in the data: the process boundary reports it).
        """
        result = self.scorer.score(group.completion_texts, group.info)
        for error in result.errors:
            if error is not None:
                REWARD_ERRORS.labels(error).inc()
        rewards = np.array(result.rewards, dtype=np.float32)
        advantages = compute_advantages(self.advantage, rewards, np.asarray(group.completion_lens, np.int64), self.eps)
        fields = {f.name: getattr(group, f.name) for f in dataclasses.fields(RolloutGroup)}
        return ScoredGroup(**fields, reward_worker=self.name, rewards=rewards, advantages=advantages)

    def close(self) -> None:
        """Stop the reward function's child processes (if isolated); idempotent."""
        self.scorer.close()


class RewardWorkerProc(Component):
    """Process wrapper of :class:`RewardWorker` (``rollouts`` in, ``scored`` out)."""

    def setup(self) -> None:
        cfg = self.cfg
        self.worker = RewardWorker(
            cfg.rewards.reward_fn or cfg.task.name,
            advantage=cfg.rewards.advantage,
            eps=cfg.rewards.eps,
            name=self.name,
            isolate=cfg.rewards.isolate,
            timeout_s=cfg.rewards.timeout_s,
            num_procs=cfg.rewards.num_procs,
        )
        producers = [self.endpoints.address("rollouts", i) for i in range(cfg.producers.max_replicas)]
        self.rollouts = self.reliable_receiver("rollouts", producers, bind=False, accept=(RolloutGroup,))
        self.scored = self.reliable_sender("scored", self.endpoints.address("scored"), bind=False)
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
            self.scored.send(scored, upstream=(self.rollouts, group.id))

    def close(self) -> None:
        worker = getattr(self, "worker", None)  # None when setup() failed before making it
        if worker is not None:
            worker.close()
        super().close()


if __name__ == "__main__":
    raise SystemExit(component_main(RewardWorkerProc))
