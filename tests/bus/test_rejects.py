"""Malformed input is counted per reason and dropped; receivers and the hub keep working.

Each case sends hostile message frames in a well-formed delivery envelope (:mod:`bus.envelope`)
to the packer's ``scored`` inbox from a raw DEALER speaking the protocol by hand, then a valid
message: the valid one arrives and is acknowledged, the hostile one never is (so a real sender
would re-send it), and ``rlbus_bus_rejected_total{topic, reason}`` grew by exactly one for the
expected reason. (Broken envelopes themselves: ``test_reliable.py``.)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import zmq

from bus.codec import decode, encode
from bus.messages import GroupsDropped, RunDone, ScoredGroup
from bus.wire import MAX_HEADER_BYTES, SCHEMA_VERSION
from reliable_peer import RawPeer
from wire_frames import edited_frames, frames_of

REJECTED = "rlbus_bus_rejected_total"


def valid_frames(example) -> list[bytes]:
    return frames_of(example("scored"))


def edit_header(edit: Callable[[dict[str, Any]], None], drop_frames: int = 0, extra: list[bytes] = ()):
    """A case that decodes the valid header, applies ``edit``, and re-packs it."""

    def build(example) -> list[bytes]:
        out = edited_frames(example("scored"), edit)
        return out[: len(out) - drop_frames] + list(extra)

    return build


def edit_array(array: str, **desc: Any):
    """A case that changes the descriptor of ``array`` (frames unchanged)."""

    def edit(header: dict[str, Any]) -> None:
        (d,) = [d for d in header["arrays"] if d["name"] == array]
        d.update(desc)

    return edit_header(edit)


def inconsistent(**changes: Any):
    """A case that encodes a well-typed message whose fields disagree (encode does not check)."""
    return lambda example: frames_of(dataclasses.replace(example("scored"), **changes))


def setitem(key: str, value: Any):
    return lambda h: h.__setitem__(key, value)


def delitem(key: str):
    return lambda h: h.pop(key)


_rng = np.random.default_rng(1234)

CASES: dict[str, tuple[str, Callable[[Any], list[bytes]]]] = {
    # frame structure
    "truncated_frames": ("frames", edit_header(lambda h: None, drop_frames=1)),
    "header_only": ("frames", lambda ex: valid_frames(ex)[:1]),
    "extra_frame": ("frames", edit_header(lambda h: None, extra=[b"\x00" * 8])),
    "arrays_not_a_list": ("frames", edit_header(setitem("arrays", {"a": 1}))),
    "arrays_missing": ("frames", edit_header(delitem("arrays"))),
    "repeated_array_name": ("frames", edit_array("sampler_logprobs", name="completion_ids")),
    "unknown_array_name": ("frames", edit_array("sampler_logprobs", name="bogus")),
    "descriptor_extra_key": ("frames", edit_array("sampler_logprobs", stride=4)),
    # arrays
    "wrong_dtype_same_itemsize": ("dtype", edit_array("completion_ids", dtype="float32")),
    "wrong_dtype_object": ("dtype", edit_array("completion_ids", dtype="object")),
    "dtype_not_a_string": ("dtype", edit_array("completion_ids", dtype=["int32"])),
    "wrong_rank": ("shape", edit_array("completion_ids", shape=[5, 1])),
    "negative_dim": ("shape", edit_array("completion_ids", shape=[-5])),
    "float_dim": ("shape", edit_array("completion_ids", shape=[5.0])),
    "shape_size_mismatch": ("size", edit_array("completion_ids", shape=[6])),
    "huge_declared_shape": ("size", edit_array("completion_ids", shape=[2**62])),
    "huge_shape_u64": ("size", edit_array("completion_ids", shape=[2**64 - 1])),
    # header
    "non_msgpack_header": ("header", lambda ex: [b"\xc1\xc1\xc1", *valid_frames(ex)[1:]]),
    "empty_header": ("header", lambda ex: [b"", *valid_frames(ex)[1:]]),
    "header_trailing_bytes": ("header", lambda ex: [valid_frames(ex)[0] + b"\x00", *valid_frames(ex)[1:]]),
    "header_not_a_map": ("header", lambda ex: [msgpack.packb(["scored", SCHEMA_VERSION])]),
    "header_without_type": ("header", lambda ex: [msgpack.packb({"schema": SCHEMA_VERSION})]),
    "type_not_a_string": ("header", edit_header(setitem("type", 3))),
    "non_string_map_key": ("header", lambda ex: [msgpack.packb({1: "x", "type": "run.done", "schema": 1})]),
    "ext_type_in_header": ("header", edit_header(setitem("info", msgpack.ExtType(1, b"pickled")))),
    "oversized_header": ("header", lambda ex: [msgpack.packb({"type": "run.done", "pad": "x" * MAX_HEADER_BYTES})]),
    "random_bytes": ("header", lambda ex: [_rng.bytes(64), _rng.bytes(4096), _rng.bytes(3)]),
    "unknown_type": ("unknown_type", edit_header(setitem("type", "rollout.v2"))),
    "wrong_schema_version": ("schema", edit_header(setitem("schema", SCHEMA_VERSION + 1))),
    "missing_schema": ("schema", edit_header(delitem("schema"))),
    # fields
    "missing_field": ("field", edit_header(delitem("step"))),
    "missing_id": ("field", edit_header(delitem("id"))),
    "int_field_as_string": ("field", edit_header(setitem("step", "2"))),
    "int_field_as_bool": ("field", edit_header(setitem("prompt_index", True))),
    "int_field_as_float": ("field", edit_header(setitem("step", 2.0))),
    "list_of_str_with_int": ("field", edit_header(setitem("completion_texts", ["a", 1, "c"]))),
    "dict_field_as_list": ("field", edit_header(setitem("info", []))),
    # prompt_messages: a list of {"role": str, "content": str}, nothing else
    "prompt_messages_as_str": ("field", edit_header(setitem("prompt_messages", "user: abc"))),
    "prompt_message_without_content": ("field", edit_header(setitem("prompt_messages", [{"role": "user"}]))),
    "prompt_message_content_not_str": (
        "field",
        edit_header(setitem("prompt_messages", [{"role": "user", "content": ["abc"]}])),
    ),
    "prompt_message_extra_key": (
        "field",
        edit_header(setitem("prompt_messages", [{"role": "user", "content": "a", "x": 1}])),
    ),
    # cross-field consistency
    "completion_lens_not_summing": ("inconsistent", inconsistent(completion_lens=np.array([2, 1, 3], np.int32))),
    "negative_completion_len": ("inconsistent", inconsistent(completion_lens=np.array([3, -1, 3], np.int32))),
    "logprobs_length": ("inconsistent", inconsistent(sampler_logprobs=np.zeros(4, np.float32))),
    "texts_per_completion": ("inconsistent", inconsistent(completion_texts=["a", "b"])),
    "version_end_before_start": ("inconsistent", inconsistent(version_end=np.array([0, 2, 3], np.int64))),
    "rewards_per_completion": ("inconsistent", inconsistent(rewards=np.zeros(2, np.float32))),
    "nan_advantage": ("inconsistent", inconsistent(advantages=np.array([0.0, np.nan, 0.0], np.float32))),
    "empty_group": (
        "inconsistent",
        inconsistent(
            completion_ids=np.zeros(0, np.int32),
            completion_lens=np.zeros(0, np.int32),
            sampler_logprobs=np.zeros(0, np.float32),
            version_start=np.zeros(0, np.int64),
            version_end=np.zeros(0, np.int64),
            completion_texts=[],
            finish_reasons=[],
            rewards=np.zeros(0, np.float32),
            advantages=np.zeros(0, np.float32),
        ),
    ),
}


@pytest.fixture
def scored_pair(couriers, ctx, endpoint):
    """A raw DEALER sender and the packer's ``scored`` inbox (a ROUTER), as reward worker -> packer."""
    receiver = couriers().receiver("scored", endpoint("scored"), bind=True, accept=(ScoredGroup,))
    raw = RawPeer(ctx, zmq.DEALER, endpoint("scored"))
    yield raw, receiver
    raw.close()


def acknowledged(raw: RawPeer, until_id: str) -> list[str]:
    """Every id the receiver acknowledged as taken, up to and including ``until_id``."""
    taken: list[str] = []

    def collect(payload) -> bool:  # payload of an ack: [free, taken_ids, done_ids]
        taken.extend(payload[1])
        return until_id in taken

    raw.wait_for("A", 2.0, collect)
    return taken


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_is_counted_and_skipped(case, scored_pair, example, metric):
    reason, build = CASES[case]
    raw, receiver = scored_pair
    frames = build(example)
    with pytest.raises(ValueError) as info:  # WireError is a ValueError
        decode(frames)
    assert getattr(info.value, "reason", None) == reason, info.value
    before = metric(REJECTED, topic="scored", reason=reason)

    raw.send_data(frames, msg_id=f"bad-{case}")
    raw.send_data(example("scored"))
    got = receiver.recv(timeout_s=2.0)

    assert got is not None and got.id == example("scored").id
    assert metric(REJECTED, topic="scored", reason=reason) == before + 1
    assert receiver.recv(timeout_s=0) is None
    assert acknowledged(raw, got.id) == [got.id]  # the hostile one was never acknowledged


def test_receiver_survives_a_burst_of_every_bad_message(scored_pair, example, metric):
    raw, receiver = scored_pair
    expected: dict[str, int] = {}
    for reason, build in CASES.values():
        expected[reason] = expected.get(reason, 0) + 1
    before = {r: metric(REJECTED, topic="scored", reason=r) for r in expected}
    before_decode = metric(REJECTED, topic="scored", reason="decode")

    for i in range(3):
        for k, (_reason, build) in enumerate(CASES.values()):
            raw.send_data(build(example), msg_id=f"bad-{i}-{k}")
        raw.send_data(dataclasses.replace(example("scored"), id=f"ok-{i}"))
    got = [receiver.recv(timeout_s=2.0) for _ in range(3)]

    assert [m.id if m else None for m in got] == ["ok-0", "ok-1", "ok-2"]
    for reason, n in expected.items():
        assert metric(REJECTED, topic="scored", reason=reason) == before[reason] + 3 * n, reason
    assert metric(REJECTED, topic="scored", reason="decode") == before_decode  # no decoder crash
    assert acknowledged(raw, "ok-2") == ["ok-0", "ok-1", "ok-2"]


def test_hub_does_not_forward_malformed_control(hub, sockets, recv_frames, sync_control, example, metric):
    pub = sockets.socket(zmq.PUB)  # a hostile publisher: raw frames, no validation
    pub.connect(hub.pub_endpoint)
    sub = sockets.socket(zmq.SUB)  # a raw subscriber sees exactly what the hub forwards
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(hub.sub_endpoint)

    def probe_recv():
        return sub.recv_multipart(copy=False) if sub.poll(50, zmq.POLLIN) else None

    sync_control(
        lambda n: pub.send_multipart(encode(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="sync"))), probe_recv
    )

    bad = {
        "header": [b"\xc1not msgpack"],
        "unknown_type": edit_header(setitem("type", "weights.evil"))(example),
        "schema": [msgpack.packb({"type": "weights.ready", "schema": 99, "arrays": []})],
        "field": [
            msgpack.packb({"type": "weights.ready", "schema": SCHEMA_VERSION, "id": "w", "version": "3", "arrays": []})
        ],
    }
    before = {r: metric(REJECTED, topic="control", reason=r) for r in bad}
    for frames in bad.values():
        pub.send_multipart(frames)
    marker = RunDone(id="after-bad", step=1, reason="marker")
    pub.send_multipart(encode(marker))

    got = decode(recv_frames(sub))  # the first thing forwarded after the bad ones is the marker
    assert isinstance(got, RunDone) and got.id == "after-bad"
    assert sub.poll(100, zmq.POLLIN) == 0
    for reason in bad:
        assert metric(REJECTED, topic="control", reason=reason) == before[reason] + 1, reason
    assert "weights.ready" not in hub.hub.last  # nothing malformed reached the last-value cache
