"""Every message type round-trips exactly over a real PUSH/PULL pair, arrays arrive zero-copy."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import zmq

from bus.messages import MESSAGE_TYPES, Message, decode, encode


def assert_same_message(got: Message, want: Message) -> None:
    assert type(got) is type(want)
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray), f.name
            assert a.dtype == b.dtype and a.dtype.isnative, (f.name, a.dtype, b.dtype)
            assert a.shape == b.shape, (f.name, a.shape, b.shape)
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        else:
            assert type(a) is type(b) and a == b, (f.name, a, b)


@pytest.fixture
def pipe(sockets, endpoint):
    """A connected raw PUSH -> PULL pair over ipc://."""
    pull = sockets.socket(zmq.PULL)
    pull.bind(endpoint("roundtrip"))
    push = sockets.socket(zmq.PUSH)
    push.connect(endpoint("roundtrip"))
    return push, pull


def transfer(pipe, recv_frames, msg: Message) -> tuple[Message, list[zmq.Frame]]:
    push, pull = pipe
    push.send_multipart(encode(msg), copy=False)
    frames = recv_frames(pull)
    return decode(frames), frames


@pytest.mark.parametrize("type_name", sorted(MESSAGE_TYPES))
def test_round_trip_every_type(type_name, example, pipe, recv_frames):
    msg = example(type_name)
    assert type(msg) is MESSAGE_TYPES[type_name]
    got, frames = transfer(pipe, recv_frames, msg)
    assert len(frames) == 1 + len(type(msg).array_specs())
    assert_same_message(got, msg)


def test_non_contiguous_and_big_endian_arrays_round_trip(micro_batch, pipe, recv_frames):
    base = micro_batch(num_tokens=20)
    strided = np.repeat(base.input_ids, 2)[::2]  # non-contiguous view
    big_endian = base.advantages.astype(">f4")  # its dtype.name is also "float32"
    msg = dataclasses.replace(base, input_ids=strided, advantages=big_endian)
    assert not msg.input_ids.flags.c_contiguous
    got, _ = transfer(pipe, recv_frames, msg)
    assert_same_message(got, base)


def test_large_arrays_are_views_of_received_frames(micro_batch, pipe, recv_frames):
    msg = micro_batch(num_tokens=100_000)  # input_ids: 400 KB, well above pyzmq's 64 KiB
    got, frames = transfer(pipe, recv_frames, msg)
    assert_same_message(got, msg)
    names = list(type(msg).array_specs())
    for name in ("input_ids", "inference_logprobs", "advantages"):
        arr = getattr(got, name)
        assert arr.nbytes > 64 * 1024
        frame = frames[1 + names.index(name)]
        assert np.shares_memory(arr, np.frombuffer(frame.buffer, dtype=np.uint8)), name
        assert not arr.flags.writeable  # a view of a read-only zmq buffer, not a copy
        assert not arr.flags.owndata


def test_bus_socket_round_trip_counts_traffic(sockets, endpoint, example, metric):
    recv = sockets.bus("scored", "recv", endpoint("scored"), bind=True)
    send = sockets.bus("scored", "send", endpoint("scored"), bind=False)
    before = {d: metric("rlbus_bus_messages_total", topic="scored", direction=d) for d in ("send", "recv")}
    msg = example("scored")
    assert send.send(msg, timeout_s=2.0)
    got = recv.recv(timeout_s=2.0)
    assert got is not None
    assert_same_message(got, msg)
    for d in ("send", "recv"):
        assert metric("rlbus_bus_messages_total", topic="scored", direction=d) == before[d] + 1
    assert recv.recv(timeout_s=0) is None


def test_unregistered_type_does_not_encode():
    @dataclasses.dataclass(frozen=True, eq=False)
    class Stray(Message):
        TYPE = "stray"

    with pytest.raises(TypeError):
        encode(Stray(id="x"))
