"""Credit windows bounded in bytes as well as messages (``bus.max_inflight_bytes``).

The state machines (:mod:`bus.inbox`, :mod:`bus.outbox`) driven by hand as in
``test_inbox_outbox.py``, then the same bound over real ZeroMQ with two couriers: a receiver is
sent at most its byte window of messages (its message window left unused), a message larger than
the window still passes alone, the outbox's ``send`` blocks on bytes not yet taken, the next
message goes to the peer with the most byte room, and the ack envelope carrying byte credit is
parsed strictly.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from bus.codec import encode
from bus.envelope import MAX_CREDIT_BYTES, parse_envelope
from bus.inbox import Inbox
from bus.messages import MicroBatch
from bus.outbox import Outbox
from bus.sockets import frame_bytes
from bus.wire import WireError
from test_inbox_outbox import IN2_KEY, IN_KEY, OUT_KEY, acks, data_ids, drain, wire
from test_reliable import QUEUED, QUIET_S, WAIT_S, open_hop, receive

TOPIC = "batches"
QUEUED_BYTES = "rlbus_bus_queued_bytes"


def big(msg_id: str, micro_batch, num_tokens: int = 20_000) -> MicroBatch:
    """A micro-batch of ``num_tokens`` tokens (~0.5 MiB on the wire) with id ``msg_id``."""
    return dataclasses.replace(micro_batch(num_tokens=num_tokens), id=msg_id)


def wire_bytes(msg: MicroBatch) -> int:
    """Bytes of ``msg``'s frames: what byte credit counts."""
    return frame_bytes(encode(msg))


def boxes(window_bytes: int, *, capacity_bytes: int | None = None, window: int = 8) -> tuple[Outbox, Inbox]:
    """An outbox (capacity 16) and an inbox that has greeted it (hello: full credit)."""
    outbox = Outbox(TOPIC, 16, capacity_bytes, session="out-1")
    inbox = Inbox(TOPIC, (MicroBatch,), window, window_bytes, session="in-1")
    inbox.dealer_links.append(0)
    wire(inbox.flush(0.0, heartbeat_due=True), outbox, IN_KEY, 0.0)
    return outbox, inbox


def send_all(outbox: Outbox, msgs: list[MicroBatch]) -> None:
    for msg in msgs:
        assert outbox.send(msg, timeout_s=0)


def test_byte_credit_bounds_what_a_receiver_is_sent(micro_batch):
    msgs = [big(f"m{i}", micro_batch) for i in range(5)]
    size = wire_bytes(msgs[0])
    outbox, inbox = boxes(window_bytes=size * 5 // 2)  # 2.5 messages; the message window is 8
    send_all(outbox, msgs)
    first = outbox.dispatch(0.0)
    assert data_ids(first) == ["m0", "m1"]
    wire(first, inbox, OUT_KEY, 0.0)
    sends = inbox.flush(0.0, heartbeat_due=False)
    assert acks(sends) == [(OUT_KEY, [6, ["m0", "m1"], [], size // 2, False])]
    wire(sends, outbox, IN_KEY, 0.0)
    assert outbox.dispatch(0.1) == []  # half a message of byte room left
    assert drain(inbox) == ["m0", "m1"]
    sends = inbox.flush(0.2, heartbeat_due=False)
    assert acks(sends) == [(OUT_KEY, [8, [], [], size * 5 // 2, True])]
    wire(sends, outbox, IN_KEY, 0.2)
    assert data_ids(outbox.dispatch(0.2)) == ["m2", "m3"]


def test_a_message_larger_than_the_window_passes_alone(micro_batch):
    msgs = [big(f"m{i}", micro_batch) for i in range(3)]
    outbox, inbox = boxes(window_bytes=wire_bytes(msgs[0]) // 3)
    send_all(outbox, msgs)
    for i in range(3):
        sends = outbox.dispatch(float(i))
        assert data_ids(sends) == [f"m{i}"]  # the inbox holds none of ours: one goes, whatever its size
        assert outbox.dispatch(float(i)) == []
        wire(sends, inbox, OUT_KEY, float(i))
        wire(inbox.flush(float(i), heartbeat_due=False), outbox, IN_KEY, float(i))
        assert outbox.dispatch(i + 0.5) == []  # received, not yet taken by the component
        assert drain(inbox) == [f"m{i}"]
        wire(inbox.flush(i + 0.5, heartbeat_due=False), outbox, IN_KEY, i + 0.5)


def test_send_blocks_on_bytes_not_yet_taken(micro_batch):
    msgs = [big(f"m{i}", micro_batch) for i in range(4)]
    size = wire_bytes(msgs[0])
    outbox, inbox = boxes(window_bytes=10 * size, capacity_bytes=size * 3 // 2)
    assert outbox.send(msgs[0], timeout_s=0)
    assert not outbox.send(msgs[1], timeout_s=0.05)  # 2 x size > 1.5 x size: waits
    sends = outbox.dispatch(0.0)
    assert not outbox.send(msgs[1], timeout_s=0.05)  # in flight is not taken
    wire(sends, inbox, OUT_KEY, 0.0)
    wire(inbox.flush(0.0, heartbeat_due=False), outbox, IN_KEY, 0.0)  # taken
    assert outbox.send(msgs[1], timeout_s=0)
    small = Outbox(TOPIC, 16, size // 2, session="out-2")
    assert small.send(msgs[2], timeout_s=0)  # larger than its byte capacity: passes alone
    assert not small.send(msgs[3], timeout_s=0.05)


def test_the_next_message_goes_to_the_peer_with_the_most_byte_room(micro_batch):
    msgs = [big(f"m{i}", micro_batch) for i in range(7)]
    size = wire_bytes(msgs[0])
    outbox, roomy = boxes(window_bytes=4 * size)
    tight = Inbox(TOPIC, (MicroBatch,), 8, 2 * size, session="in-2")
    tight.dealer_links.append(0)
    wire(tight.flush(0.0, heartbeat_due=True), outbox, IN2_KEY, 0.0)
    send_all(outbox, msgs)
    sends = outbox.dispatch(0.0)
    # byte room (in messages) before each send, roomy/tight: unbounded/unbounded (holding none of
    # ours: one passes whatever its size; roomy joined first), 3/unbounded, 3/1, 2/1, 1/1 (a tie: the
    # most message room, tight's 7 against roomy's 5), 1/0; the 7th waits. Round-robin (R T R T R R)
    # and first fit (R R R R T T) give the same totals, 4 and 2.
    r, t = IN_KEY, IN2_KEY
    assert [send.key for send in sends] == [r, t, r, r, t, r]
    assert data_ids(sends) == [f"m{i}" for i in range(6)]  # oldest first


@pytest.mark.parametrize("window_messages", [2.5, 0.5])
def test_a_stalled_receiver_holds_at_most_its_byte_window(
    window_messages, couriers, endpoint, micro_batch, metric, wait_until
):
    size = wire_bytes(big("b-0", micro_batch))  # ids of the same length: the same size
    limit = int(window_messages * size)
    ep = endpoint("batches")
    outbox, inbox = open_hop(
        couriers(max_inflight_bytes=limit), couriers(max_inflight_bytes=limit), TOPIC, ep, window=8, capacity=8
    )
    assert (inbox.window_bytes, outbox.capacity_bytes) == (limit, limit)
    handed = 0
    while outbox.send(big(f"b-{handed}", micro_batch), timeout_s=1.0):  # the receiver never recv()s
        handed += 1
        assert handed <= 16, "send() never blocked"
    per_side = max(int(window_messages), 1)  # what fits the window, or one message alone
    assert handed == 2 * per_side  # in the inbox, and not yet taken in the outbox
    wait_until(
        lambda: metric(QUEUED, topic=TOPIC, queue="inbox") == per_side, WAIT_S, "the inbox holds its byte window"
    )
    assert metric(QUEUED_BYTES, topic=TOPIC, queue="inbox") == per_side * size
    assert metric(QUEUED_BYTES, topic=TOPIC, queue="outbox_not_taken") == per_side * size
    assert receive(inbox, handed) == [f"b-{i}" for i in range(handed)]
    assert inbox.recv(timeout_s=QUIET_S) is None
    wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "all done")


def test_ack_envelopes_with_byte_credit_are_parsed_strictly():
    def ack(payload) -> bytes:
        return msgpack.packb([1, "A", "s", payload])

    assert parse_envelope(ack([3, ["a"], [], 1024, False]))[2] == [3, ["a"], [], 1024, False]
    assert parse_envelope(ack([3, [], []]))[2] == [3, [], []]  # a receiver without a byte bound
    for bad in (
        [3, [], [], 1024],
        [3, [], [], -1, True],
        [3, [], [], MAX_CREDIT_BYTES + 1, True],
        [3, [], [], 1024, 1],
        [3, [], [], True, True],
        [3, [], [], 1.5, True],
        [3, [], [], 10, True, 0],
    ):
        with pytest.raises(WireError, match="free_bytes"):
            parse_envelope(ack(bad))


def test_byte_bounds_refuse_bad_values():
    with pytest.raises(ValueError, match="window_bytes"):
        Inbox(TOPIC, (MicroBatch,), 2, 0, session="s")
    with pytest.raises(ValueError, match="capacity_bytes"):
        Outbox(TOPIC, 2, 0, session="s")
