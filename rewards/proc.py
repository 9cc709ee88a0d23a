"""The reward worker process (``python -m rewards.proc``): :class:`rewards.worker.RewardWorker` between
every producer's ``rollouts`` (all ``producers.max_replicas``) and the packer's ``scored``. A group
is one message, so workers share no state; custody (:mod:`bus.courier`) releases a rollout only
once the packer is done with its scored group.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

from bus.component import Component, component_main
from bus.messages import RolloutGroup, RunDone
from telemetry.metrics import StageMeter
from rewards.shaping import overlong_section
from rewards.worker import RewardWorker
from tasks.registry import reward_spec
from telemetry.failure_window import FailureWindows

GROUPS_SCORED = Counter("rlbus_rewards_groups_total", "Groups scored")
REWARD = Histogram("rlbus_rewards_reward", "Reward per sample", buckets=[i / 10 for i in range(11)])
SCORE_SECONDS = Histogram("rlbus_rewards_score_seconds", "Time to score one group, seconds")
ADVANTAGE = Histogram(
    "rlbus_rewards_advantage",
    "Group-relative advantage per sample",
    buckets=(-4, -3, -2, -1.5, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 4),
)


class RewardWorkerProc(Component):
    """Process wrapper of :class:`RewardWorker`."""

    def setup(self) -> None:
        cfg = self.cfg
        r = cfg.rewards
        self.failures = FailureWindows(
            window=r.error_window, warn_fraction=r.warn_error_fraction, max_fraction=r.max_error_fraction
        )  # reported in heartbeats: busctl up warns and stops the run
        self.worker = RewardWorker(
            reward_spec(cfg),
            advantage=cfg.rewards.advantage,
            eps=cfg.rewards.eps,
            name=self.name,
            isolate=cfg.rewards.isolate,
            timeout_s=cfg.rewards.timeout_s,
            num_procs=cfg.rewards.num_procs,
            filters=cfg.filters,
            overlong=overlong_section(cfg),
            max_steps=cfg.trainer.max_steps,
            failures=self.failures,
        )
        producers = [self.endpoints.address("rollouts", i) for i in range(cfg.producers.max_replicas)]
        self.rollouts = self.reliable_receiver("rollouts", producers, bind=False, accept=(RolloutGroup,))
        self.scored = self.reliable_sender("scored", self.endpoints.address("scored"), bind=False)
        self.control = self.control_subscriber()
        self.meter = StageMeter("rewards")

    def run(self) -> None:
        while not self.stop.is_set():
            ctl = self.control.recv(timeout_s=0)
            if isinstance(ctl, RunDone):
                return
            group = self.rollouts.recv(timeout_s=0.2)
            if group is None:
                continue
            started = time.perf_counter()
            with self.meter.work():
                scored = self.worker.score(group)
            SCORE_SECONDS.observe(time.perf_counter() - started)
            for r, a in zip(scored.rewards, scored.advantages):
                REWARD.observe(float(r))
                ADVANTAGE.observe(float(a))
            GROUPS_SCORED.inc()
            self.meter.finished(scored.group_size, int(scored.completion_lens.sum()))
            self.scored.send(scored, upstream=(self.rollouts, group.id))

    def close(self) -> None:
        worker = getattr(self, "worker", None)  # None when setup() failed before making it
        if worker is not None:
            worker.close()
        super().close()


if __name__ == "__main__":
    raise SystemExit(component_main(RewardWorkerProc))
