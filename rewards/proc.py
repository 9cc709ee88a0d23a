"""The reward worker process: :class:`RewardWorkerProc` wraps :class:`rewards.worker.RewardWorker`.

It receives from every producer's ``rollouts`` endpoint (all ``producers.max_replicas`` of them, so
producers added later are reached) and sends to the packer's ``scored`` endpoint, so any number of
workers can run side by side; one message is one whole group, so a worker needs no state shared
with the others. Custody (:mod:`bus.courier`): a rollout is released to its producer only once the
packer is done with its scored group; a worker killed at any moment loses nothing.

Run as ``python -m rewards.proc --run-dir RUN_DIR --name rewards-0 --index 0`` (the supervisor
does, see ``bus/component_table.py``). The reward functions of the run are those of
:func:`tasks.registry.reward_spec`.
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

GROUPS_SCORED = Counter("rlbus_rewards_groups_total", "Groups scored")
REWARD = Histogram("rlbus_rewards_reward", "Reward per sample", buckets=[i / 10 for i in range(11)])
SCORE_SECONDS = Histogram("rlbus_rewards_score_seconds", "Time to score one group, seconds")
ADVANTAGE = Histogram(
    "rlbus_rewards_advantage",
    "Group-relative advantage per sample",
    buckets=(-4, -3, -2, -1.5, -1, -0.5, -0.25, -0.1, 0, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 4),
)


class RewardWorkerProc(Component):
    """Process wrapper of :class:`RewardWorker` (``rollouts`` in, ``scored`` out)."""

    def setup(self) -> None:
        cfg = self.cfg
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
