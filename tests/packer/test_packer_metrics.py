"""The packer's observability on a real bus: Prometheus metrics read from the process's real
registry (what ``/metrics`` serves) and the ``samples.jsonl`` examples.

Checked, per emitted step: ``rlbus_packer_micro_batches_per_step`` observes the step's
micro-batch count, ``rlbus_packer_padding_ratio`` is ``1 - tokens / (micro-batches x budget)`` of
the micro-batches the trainer received, ``rlbus_packer_policy_lag_steps`` gets one observation
per sample at ``step - version_start``; the ``packer`` stage meter counts the accepted groups'
samples and completion tokens, one latency per received group and busy time; every known
outcome of the group counters exists (at 0) before any group arrives; every sampled step's
examples land in ``samples.jsonl`` with the groups' own rewards, advantages and texts.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from prometheus_client import REGISTRY

from bus.messages import MicroBatch
from packer.evaluation import EvalDecision
from packer.packer import DropReason
from tests.packer.test_packer_proc import WAIT_S, LiveBus, group, packer, receive_step, wait_until  # noqa: F401 (fixture)
from tests.socket_dirs import remove_outside_socket_dir

BUDGET = 16


def value(name: str, **labels: str) -> float:
    """Current value of one sample of the default registry (0.0 when the series does not exist)."""
    got = REGISTRY.get_sample_value(name, labels)
    return 0.0 if got is None else got


def lag_buckets() -> dict[str, float]:
    return {
        s.labels["le"]: s.value
        for m in REGISTRY.collect()
        if m.name == "rlbus_packer_policy_lag_steps"
        for s in m.samples
        if s.name.endswith("_bucket")
    }


@pytest.fixture
def live(tmp_path):
    # 2 groups of 2 samples per step, 16-token micro-batches; every step sampled, 3 examples each
    bus = LiveBus(
        tmp_path,
        [
            "trainer.batch_size=4",
            "producers.group_size=2",
            f"packer.micro_batch_tokens={BUDGET}",
            "packer.max_off_policy_steps=2",
            "max_async_level=1",
            "report.samples_interval=1",
            "report.samples_per_step=3",
        ],
    )
    yield bus
    bus.close()
    remove_outside_socket_dir(tmp_path)


GROUP_LABELS = (
    "accepted",
    "duplicate",
    "empty_prompt",
    "too_long",
    "no_teacher",
    "filtered: equal_rewards",
    "filtered: online_difficulty",
    "stale",
)
EVAL_LABELS = ("taken", "duplicate", "late", "invalid")


def test_every_known_outcome_exists_from_the_start(live, packer):
    assert {*DropReason} | {"accepted", "duplicate"} == set(GROUP_LABELS)  # the enums' values are the label text
    assert {*EvalDecision} == set(EVAL_LABELS)
    for outcome in GROUP_LABELS:
        assert REGISTRY.get_sample_value("rlbus_packer_groups_total", {"outcome": outcome}) is not None, outcome
    for outcome in EVAL_LABELS:
        assert REGISTRY.get_sample_value("rlbus_packer_eval_groups_total", {"outcome": outcome}) is not None, outcome
    for name in ("rlbus_stage_busy_seconds_total", "rlbus_stage_idle_seconds_total", "rlbus_stage_samples_total"):
        assert REGISTRY.get_sample_value(name, {"stage": "packer"}) is not None, name
    assert REGISTRY.get_sample_value("rlbus_packer_micro_batches") is None  # replaced by the histogram


def test_step_metrics_stage_meter_and_samples_log(live, packer):
    packer, _thread = packer
    scored = live.courier().sender("scored", live.endpoints.address("scored"), bind=False)
    trainer = live.courier().receiver("batches", live.endpoints.address("batches"), bind=False, accept=(MicroBatch,))
    before = {
        "mb_count": value("rlbus_packer_micro_batches_per_step_count"),
        "mb_sum": value("rlbus_packer_micro_batches_per_step_sum"),
        "lag_count": value("rlbus_packer_policy_lag_steps_count"),
        "lag_sum": value("rlbus_packer_policy_lag_steps_sum"),
        "samples": value("rlbus_stage_samples_total", stage="packer"),
        "tokens": value("rlbus_stage_tokens_total", stage="packer"),
        "latency": value("rlbus_stage_latency_seconds_count", stage="packer"),
        "busy": value("rlbus_stage_busy_seconds_total", stage="packer"),
        "accepted": value("rlbus_packer_groups_total", outcome="accepted"),
    }
    buckets_before = lag_buckets()
    # step 0: versions 0 (lag 0); step 1: one group sampled under version 0 (lag 1), one under 1
    sent = [
        dataclasses.replace(
            group("a", [1.0, 0.0], version=0),
            prompt_text="<user>abc</user>",
            completion_texts=["cba", "abc"],
            reward_terms={"lcs": [1.0, 0.0]},
        ),
        group("b", [0.25, 0.75], version=0),
        group("c", [0.5, 0.0], version=0),
        group("d", [0.0, 1.0], version=1),
    ]
    for msg in sent:
        assert scored.send(msg, timeout_s=WAIT_S)
    steps = [receive_step(trainer, 0), receive_step(trainer, 1)]
    wait_until(
        lambda: (
            value("rlbus_packer_steps_total") >= 2
            and packer.samples_log.path.is_file()
            and len(packer.samples_log.path.read_text().splitlines()) == 6
        ),
        "two steps emitted and logged",
    )

    # micro-batches per step and padding of the last step, from what the trainer received
    counts = [len(s) for s in steps]
    assert value("rlbus_packer_micro_batches_per_step_count") - before["mb_count"] == 2
    assert value("rlbus_packer_micro_batches_per_step_sum") - before["mb_sum"] == sum(counts)
    tokens = sum(len(mb.input_ids) for mb in steps[1])
    assert value("rlbus_packer_padding_ratio") == pytest.approx(1 - tokens / (counts[1] * BUDGET))
    # one lag observation per sample: step 0 all 0; step 1: c at 1 - 0 = 1 (x2), d at 1 - 1 = 0 (x2)
    lags = [mb.step - int(v) for s in steps for mb in s for v in mb.oldest_versions]
    assert sorted(lags) == [0, 0, 0, 0, 0, 0, 1, 1]
    assert value("rlbus_packer_policy_lag_steps_count") - before["lag_count"] == 8
    assert value("rlbus_packer_policy_lag_steps_sum") - before["lag_sum"] == 2
    after = lag_buckets()
    assert after["0.0"] - buckets_before.get("0.0", 0) == 6 and after["1.0"] - buckets_before.get("1.0", 0) == 8

    # the stage meter: 4 groups accepted (8 samples, 5 completion tokens each), 4 handled
    assert value("rlbus_stage_samples_total", stage="packer") - before["samples"] == 8
    assert value("rlbus_stage_tokens_total", stage="packer") - before["tokens"] == 8 * 5
    assert value("rlbus_stage_latency_seconds_count", stage="packer") - before["latency"] == 4
    assert value("rlbus_stage_busy_seconds_total", stage="packer") > before["busy"]
    assert value("rlbus_packer_groups_total", outcome="accepted") - before["accepted"] == 4

    # samples.jsonl: the first 3 samples of each step (its groups in packing order), with the groups' values
    records = [json.loads(line) for line in packer.samples_log.path.read_text().splitlines()]
    by_id = {g.id: g for g in sent}
    assert [(r["step"], r["group_id"], r["sample"]) for r in records] == [
        (0, "a", 0),
        (0, "a", 1),
        (0, "b", 0),
        (1, "c", 0),
        (1, "c", 1),
        (1, "d", 0),
    ]
    for r in records:
        g = by_id[r["group_id"]]
        j = r["sample"]
        assert r["reward"] == pytest.approx(float(g.rewards[j])) and r["advantage"] == pytest.approx(
            float(g.advantages[j])
        )
        assert (r["completion"], r["prompt"], r["finish_reason"]) == (g.completion_texts[j], g.prompt_text, "stop")
        assert (r["policy_version"], r["lag"]) == (int(g.version_start[j]), r["step"] - int(g.version_start[j]))
        assert r["task"] == "reverse_text" and r["group_size"] == 2 and r["completion_tokens"] == 5
    assert records[0]["prompt"] == "<user>abc</user>" and records[0]["reward_terms"] == {"lcs": 1.0}
    assert records[1]["completion"] == "abc" and records[1]["reward_terms"] == {"lcs": 0.0}
    # whole group a: its advantages sum to 0
    assert sum(r["advantage"] for r in records[:2]) == pytest.approx(0.0)
    assert packer.samples_log.errors == 0
    assert np.isclose(sum(r["advantage"] for r in records if r["group_id"] == "c"), 0.0)
