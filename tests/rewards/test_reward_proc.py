"""RewardWorkerProc on a real bus (ZeroMQ over ipc://): a producer's rollouts in, scored groups out,
with the run's overlong shaping and a TRL-style reward from the config; then with a real
PackerProc behind it, whose zero-variance filter (``packer.filter_equal_rewards``) drops and counts
a group of equal shaped rewards. Producer, packer (first test) and ledger are real
:class:`bus.courier.Courier` peers; the rewards are hand-computed."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import trl_reward_fns
import zmq
from test_worker import rollout

from bus.courier import Courier
from bus.messages import GroupsDropped, ScoredGroup
from bus.topics import Endpoints
from configs.schema import load_config
from packer.proc import PackerProc
from rewards.proc import RewardWorkerProc
from tests import waiting
from tests.outcomes_sink import OutcomesSink
from tests.socket_dirs import remove_outside_socket_dir

TIMINGS = dict(heartbeat_s=0.05, dead_after_s=0.6, ack_timeout_s=3.0)
WAIT_S = 10.0


@pytest.fixture
def peers(tmp_path):
    """The run config, and a producer and a packer courier (one context each), closed at teardown."""
    overrides = [
        f"run_dir={tmp_path}",
        *(f"bus.{k}={v}" for k, v in TIMINGS.items()),
        "rewards.isolate=false",
        "producers.max_replicas=1",
        "sampling.max_tokens=8",
        "rewards.overlong={buffer_tokens: 4, penalty: 0.5}",
        "producers.group_size=4",
        "trainer.batch_size=4",
        "packer.filter_equal_rewards=true",
        f"task.rewards=[{{name: reverse_text}}, {{name: 'trl:{trl_reward_fns.__name__}:token_count', weight: 0.25}}]",
    ]
    cfg = load_config(None, overrides)
    Endpoints("ipc", tmp_path).ensure_dirs()
    couriers = [Courier(zmq.Context(), **TIMINGS) for _ in range(3)]
    yield cfg, couriers
    for courier in couriers:
        courier.stop.set()
        courier.close()
        courier.ctx.destroy(linger=0)
    remove_outside_socket_dir(tmp_path)


def test_a_group_is_shaped_scored_and_released(peers, metric):
    cfg, (producer_courier, packer_courier, _) = peers
    endpoints = Endpoints("ipc", cfg.run_dir)
    producer = producer_courier.sender("rollouts", endpoints.address("rollouts", 0), bind=True)
    packer = packer_courier.receiver("scored", endpoints.address("scored"), bind=True, accept=(ScoredGroup,))
    proc = RewardWorkerProc(cfg, "rewards-0", 0)
    thread = threading.Thread(target=proc.run, daemon=True)
    soft, hard = (
        metric("rlbus_rewards_overlong_total", zone="soft"),
        metric("rlbus_rewards_overlong_total", zone="hard"),
    )
    try:
        proc.setup()
        thread.start()
        # lens [3, 6, 9] of L_max 8, L_cache 4 -> R = [0, -0.5, -1]; reverse_text (target "olleh"):
        # "olleh" 1, "oll" 2*3/(3+5) = 0.75, "" 0; token_count = lens, weight 0.25
        # rewards = [1 + 0.75, 0.75 + 1.5 - 0.25, 0 + 2.25 - 0.5] = [1.75, 2.0, 1.75]
        group = dataclasses.replace(
            rollout(["olleh", "oll", ""]),
            completion_lens=np.int32([3, 6, 9]),
            completion_ids=np.arange(18, dtype=np.int32),
            sampler_logprobs=np.full(18, -0.5, np.float32),
        )
        assert producer.send(group, timeout_s=WAIT_S)
        scored = waiting.wait_until(lambda: packer.recv(timeout_s=0.1), "the scored group", WAIT_S)
        assert scored.id == group.id and scored.reward_worker == "rewards-0"
        assert scored.reward_terms == {
            "reverse_text": [1.0, 0.75, 0.0],
            "token_count": [3.0, 6.0, 9.0],
            "overlong": [0.0, -0.5, -1.0],
        }
        assert scored.rewards.tolist() == [1.75, 2.0, 1.75]
        assert (
            metric("rlbus_rewards_overlong_total", zone="soft") - soft,
            metric("rlbus_rewards_overlong_total", zone="hard") - hard,
        ) == (1, 1)
        # custody: the producer holds the rollout until the packer is done with its scored group
        assert producer.unfinished() == 1
        packer.done(scored.id)
        waiting.wait_until(lambda: producer.unfinished() == 0, "the rollout released", WAIT_S)
    finally:
        proc.stop.set()
        thread.join(timeout=WAIT_S)
        proc.close()


def start(proc_type: type, cfg, name: str) -> tuple[object, threading.Thread]:
    proc = proc_type(cfg, name, 0)
    proc.setup()
    thread = threading.Thread(target=proc.run, daemon=True)
    thread.start()
    return proc, thread


def test_the_packer_drops_and_counts_a_zero_variance_group(peers, metric):
    cfg, (producer_courier, _, ledger_courier) = peers
    endpoints = Endpoints("ipc", cfg.run_dir)
    producer = producer_courier.sender("rollouts", endpoints.address("rollouts", 0), bind=True)
    ledger = OutcomesSink(ledger_courier, endpoints.address("outcomes"))
    outcome = {o: metric("rlbus_packer_groups_total", outcome=o) for o in ("accepted", "filtered: equal_rewards")}
    procs = []
    try:
        procs.append(start(PackerProc, cfg, "packer"))
        procs.append(start(RewardWorkerProc, cfg, "rewards-0"))
        # "olleh" scores 1 (reverse_text) + 0.25 * tokens (token_count) + 0.5 * R (L_max 8, L_cache 4):
        # lens [3, 3, 3, 3] -> 1.75 each: zero variance, dropped;
        # lens [3, 3, 3, 9] -> [1.75, 1.75, 1.75, 1 + 2.25 - 0.5 = 2.75]: taken
        for gid, lens in (("equal", [3, 3, 3, 3]), ("varied", [3, 3, 3, 9])):
            n = sum(lens)
            group = dataclasses.replace(
                rollout(["olleh"] * 4),
                id=gid,
                completion_lens=np.int32(lens),
                completion_ids=np.arange(n, dtype=np.int32),
                sampler_logprobs=np.full(n, -0.5, np.float32),
            )
            assert producer.send(group, timeout_s=WAIT_S)
        (drop,) = ledger.wait_for(lambda sink: sink.received(), "the drop of the zero-variance group")
        assert (type(drop), drop.group_ids, drop.reason) == (GroupsDropped, ["equal"], "filtered: equal_rewards")
        waiting.wait_until(
            lambda: metric("rlbus_packer_groups_total", outcome="accepted") - outcome["accepted"] == 1,
            "the varied group taken",
            WAIT_S,
        )
        assert (
            metric("rlbus_packer_groups_total", outcome="filtered: equal_rewards") - outcome["filtered: equal_rewards"]
            == 1
        )
        # both rollouts released: the taken one at once, the dropped one once the ledger recorded its drop
        waiting.wait_until(lambda: producer.unfinished() == 0, "both rollouts released", WAIT_S)
    finally:
        for proc, thread in reversed(procs):
            proc.stop.set()
            thread.join(timeout=WAIT_S)
            proc.close()
        ledger.close()
