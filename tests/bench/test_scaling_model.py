"""bench.scaling_model (the paper model of docs/scaling.md): its invariants on every policy,
workload and GPU count it tabulates, with message sizes from real rlbus encodings."""

from __future__ import annotations

import dataclasses
import math

import pytest

from bench import scaling_inputs as inputs
from bench.scaling_model import configure, headroom, hop_capacity, main, message_sizes, topic_rates, weight_sync

CASES = [(p, w) for p in inputs.POLICIES for w in inputs.WORKLOADS]


@pytest.mark.parametrize("policy,w", CASES, ids=lambda x: x.name)
def test_traffic_is_linear_in_gpus(policy, w) -> None:
    # doubling the GPUs doubles every topic's messages/s and bytes/s, up to whole-replica rounding
    sizes = message_sizes(w)
    for small, big in zip(inputs.GPU_COUNTS, inputs.GPU_COUNTS[1:]):
        a, b = configure(policy, w, small), configure(policy, w, big)
        tol = 2 * policy.tp / a.gen_gpus + 2 / a.train_gpus
        ra, rb = topic_rates(a, sizes), topic_rates(b, sizes)
        for topic in ("prompts", "rollouts", "scored", "batches"):
            assert rb[topic][1] / ra[topic][1] == pytest.approx(big / small, rel=tol), topic
            assert rb[topic][1] / rb[topic][0] == pytest.approx(sizes[topic])  # bytes = messages x size
        # the control fan-out grows faster than linearly: every producer's announcement reaches everyone
        assert rb["control"][0] / ra["control"][0] > (big / small) * 1.5


@pytest.mark.parametrize("policy,w", CASES, ids=lambda x: x.name)
def test_split_balances_generation_and_training(policy, w) -> None:
    frac = w.completion_tokens / (w.prompt_tokens + w.completion_tokens)
    for gpus in inputs.GPU_COUNTS:
        c = configure(policy, w, gpus)
        assert c.gen_gpus + c.train_gpus == gpus and c.gen_gpus == c.replicas * policy.tp
        produced = c.gen_gpus * policy.gen_tok_s.value
        consumed = c.train_gpus * policy.train_tok_s.value * frac
        # one replica more or less would not bring the two closer
        one = policy.tp * (policy.gen_tok_s.value + policy.train_tok_s.value * frac)
        assert abs(produced - consumed) <= one
        assert c.completion_tok_s == pytest.approx(min(produced, consumed))
        step_tokens = w.prompts_per_step * w.group_size * (w.prompt_tokens + w.completion_tokens)
        assert c.step_s * c.groups_s * w.group_size * (w.prompt_tokens + w.completion_tokens) == pytest.approx(
            step_tokens
        )


@pytest.mark.parametrize("policy,w", CASES, ids=lambda x: x.name)
def test_weight_sync_is_bandwidth_bound(policy, w) -> None:
    for gpus in inputs.GPU_COUNTS:
        c = configure(policy, w, gpus)
        s = weight_sync(c)
        payload = policy.params * inputs.WIRE_DTYPE_BYTES
        assert s["payload_GB"] * 1e9 == pytest.approx(payload)
        assert s["nccl_bound"] == pytest.approx(payload / inputs.IB_PER_GPU.value)
        assert s["buckets"] * inputs.BUCKET_BYTES >= payload > (s["buckets"] - 1) * inputs.BUCKET_BYTES
        for key, seconds in s.items():
            if key not in ("payload_GB", "buckets", "fsdp_gather"):
                assert seconds >= s["nccl_bound"], key  # nothing beats the link
        # one writer + every replica reading the whole payload: never faster than the reads allow
        for r in inputs.FS_AGGREGATE_READ:
            assert s[f"fs_{r / 1e9:.0f}"] >= c.replicas * payload / r
        assert s["bus_star"] >= c.replicas * payload / inputs.IB_PER_GPU.value
        assert s["bus_tree"] >= payload / inputs.BUS_STREAM.value


def test_message_sizes_follow_the_wire_format() -> None:
    w = inputs.WORKLOADS[0]
    base = message_sizes(w)
    longer = message_sizes(dataclasses.replace(w, completion_tokens=2 * w.completion_tokens))
    extra_tokens = w.group_size * w.completion_tokens
    # per completion token: int32 id + float32 logprob + its decoded text (chars_per_token bytes)
    per_token = 4 + 4 + w.chars_per_token
    for topic in ("rollouts", "scored"):
        assert (longer[topic] - base[topic]) / extra_tokens == pytest.approx(per_token, rel=1e-3), topic
    assert base["scored"] > base["rollouts"]  # + rewards, advantages, reward terms
    # a micro-batch: int32 ids + bool mask + float32 logprobs + float32 advantages + int64 versions
    wide = message_sizes(dataclasses.replace(w, micro_batch_tokens=2 * w.micro_batch_tokens))
    assert (wide["batches"] - base["batches"]) / w.micro_batch_tokens == pytest.approx(4 + 1 + 4 + 4 + 8, rel=0.02)


def test_hop_capacity_interpolates_the_measured_points() -> None:
    for size, bytes_s in inputs.HOP_POINTS:
        assert hop_capacity(size) * size == pytest.approx(bytes_s)
    # between points bytes/s lies between its neighbours; outside, bytes/s stays at the end values
    (s0, b0), (s1, b1) = inputs.HOP_POINTS[:2]
    mid = int(math.sqrt(s0 * s1))
    assert min(b0, b1) <= hop_capacity(mid) * mid <= max(b0, b1)
    assert hop_capacity(64) == pytest.approx(b0 / 64)
    assert hop_capacity(1 << 30) * (1 << 30) == pytest.approx(inputs.HOP_POINTS[-1][1])


def test_headroom_shrinks_as_the_run_grows() -> None:
    policy, w = inputs.POLICIES[0], inputs.WORKLOADS[0]
    sizes = message_sizes(w)
    small, big = headroom(configure(policy, w, 64), sizes), headroom(configure(policy, w, 1024), sizes)
    for hop in ("prompt source", "packer", "packer fsync", "trainer rank 0", "hub egress"):
        assert big[hop] < small[hop], hop


def test_inputs_are_cited_and_the_bucket_size_is_rlbus_s() -> None:
    from broadcaster.manifest import DEFAULT_BUCKET_BYTES

    assert inputs.BUCKET_BYTES == DEFAULT_BUCKET_BYTES
    cited = [p.gen_tok_s for p in inputs.POLICIES] + [p.train_tok_s for p in inputs.POLICIES]
    cited += [inputs.IB_PER_GPU, inputs.BUS_STREAM, inputs.HOP_SOURCE, inputs.FS_WRITE, inputs.FSYNC_S]
    assert all(c.source and c.value > 0 for c in cited)
    with pytest.raises(ValueError, match="gpus=4"):
        configure(inputs.POLICIES[1], inputs.WORKLOADS[0], 4)


def test_main_prints_every_table(capsys) -> None:
    main()
    out = capsys.readouterr().out
    for policy in inputs.POLICIES:
        assert f"## {policy.name}: weight sync" in out
        for w in inputs.WORKLOADS:
            assert f"## {policy.name}, workload {w.name}" in out
    assert out.count("| GPUs |") == len(inputs.POLICIES) * (3 * len(inputs.WORKLOADS) + 1)


def test_docs_scaling_shows_the_current_tables(capsys) -> None:
    # docs/scaling.md's "Tables" section is this script's output: re-run it after changing an input
    from pathlib import Path

    main()
    doc = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    stale = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|") and line not in doc]
    assert not stale, f"docs/scaling.md is stale (python -m bench.scaling_model): {stale[:3]}"
