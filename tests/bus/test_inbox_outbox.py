"""The delivery state machines (:mod:`bus.inbox`, :mod:`bus.outbox`) driven with plain lists of
frames and a fake clock, without a socket or a thread: what :class:`bus.courier.Courier` does with
real ZeroMQ (``test_reliable.py``) done here by hand, one step at a time.

``wire`` carries what one box returned to the other: it parses each envelope with
:func:`bus.envelope.parse_envelope` and hands the frame set to the other box's ``on_frames``, as
the courier does after ``recv_multipart``. Checked: credit grant and hello, dispatch limited by
credit, taken / done acks finishing a message and releasing its upstream, duplicates acknowledged
and never delivered twice, ack timeout and lost peers re-sending (to another peer), a frame set
that could not go out, capacity (backpressure) and done / release returning credit.
"""

from __future__ import annotations

import msgpack
import pytest

from bus.envelope import PeerKey, Send, parse_envelope
from bus.inbox import Inbox
from bus.outbox import Outbox
from reliable_peer import ACCEPT, data_message, frames_of

TOPIC = "scored"
IN_KEY: PeerKey = (0, b"inbox")  # how the outbox knows the inbox (a ROUTER routing id)
IN2_KEY: PeerKey = (0, b"inbox2")
OUT_KEY: PeerKey = (0, b"")  # how the inbox knows the outbox (its DEALER link)


def make_inbox(window: int = 4, session: str = "in-1") -> Inbox:
    return Inbox(TOPIC, ACCEPT[TOPIC], window, session=session)


def make_outbox(capacity: int = 8) -> Outbox:
    return Outbox(TOPIC, capacity, session="out-1")


def wire(sends: list[Send], to: Inbox | Outbox, key: PeerKey, now: float) -> None:
    """Deliver every frame set of ``sends`` to ``to`` as coming from peer ``key``."""
    for send in sends:
        kind, session, payload = parse_envelope(send.frames[0])
        to.on_frames(key, kind, session, payload, send.frames[1:], now)


def acks(sends: list[Send]) -> list[tuple[PeerKey, list]]:
    """``(key, [free, taken, done])`` of every ``A`` in ``sends``."""
    out = []
    for send in sends:
        _, kind, _, payload = msgpack.unpackb(send.frames[0])
        if kind == "A":
            out.append((send.key, payload))
    return out


def data_ids(sends: list[Send]) -> list[str]:
    """Message ids of the ``D`` frame sets in ``sends``, in order."""
    return [msgpack.unpackb(s.frames[0])[3] for s in sends if msgpack.unpackb(s.frames[0])[1] == "D"]


def send_all(outbox: Outbox, *ids: str, **kw) -> None:
    for msg_id in ids:
        assert outbox.send(data_message(TOPIC, msg_id), timeout_s=0, **kw)


def drain(inbox: Inbox) -> list[str]:
    got = []
    while (msg := inbox.recv(timeout_s=0)) is not None:
        got.append(msg.id)
    return got


def test_inbox_greets_its_dealer_and_grants_credit_to_a_new_sender():
    inbox = make_inbox(window=3)
    inbox.dealer_links.append(0)
    assert acks(inbox.flush(0.0, heartbeat_due=True)) == [(OUT_KEY, [3, [], []])]  # hello before it speaks
    assert inbox.flush(0.1, heartbeat_due=False) == []
    wire([Send(IN_KEY, [msgpack.packb([1, "H", "out-1", None])])], inbox, OUT_KEY, 0.2)
    assert acks(inbox.flush(0.2, heartbeat_due=False)) == [(OUT_KEY, [3, [], []])]  # credit at once
    assert inbox.flush(0.3, heartbeat_due=False) == []  # nothing changed: nothing to say


def test_dispatch_is_limited_by_credit_and_taken_acks_free_it():
    outbox, inbox = make_outbox(), make_inbox(window=2)
    send_all(outbox, "m0", "m1", "m2", "m3")
    assert outbox.dispatch(0.0) == []  # no receiver known yet
    wire(inbox.flush(0.0, heartbeat_due=True), outbox, IN_KEY, 0.0)  # no DEALER link: no hello
    inbox.dealer_links.append(0)
    wire(inbox.flush(0.0, heartbeat_due=True), outbox, IN_KEY, 0.0)
    first = outbox.dispatch(0.0)
    assert data_ids(first) == ["m0", "m1"]  # oldest first, two of credit
    assert outbox.dispatch(0.1) == []
    wire(first, inbox, OUT_KEY, 0.1)
    wire(inbox.flush(0.1, heartbeat_due=False), outbox, IN_KEY, 0.1)  # taken, but the inbox is full
    assert acks(inbox.flush(0.1, heartbeat_due=False)) == []
    assert outbox.dispatch(0.1) == []
    assert drain(inbox) == ["m0", "m1"]
    wire(inbox.flush(0.2, heartbeat_due=False), outbox, IN_KEY, 0.2)  # credit back
    assert data_ids(outbox.dispatch(0.2)) == ["m2", "m3"]


def connected(window: int = 4, capacity: int = 8) -> tuple[Outbox, Inbox]:
    outbox, inbox = make_outbox(capacity), make_inbox(window)
    inbox.dealer_links.append(0)
    wire(inbox.flush(0.0, heartbeat_due=True), outbox, IN_KEY, 0.0)
    return outbox, inbox


def test_done_finishes_the_message_and_releases_its_upstream():
    upstream = make_inbox()
    wire(
        [Send(OUT_KEY, [msgpack.packb([1, "D", "prod", "u1"]), *frames_of(data_message(TOPIC, "u1"))])],
        upstream,
        (0, b"prod"),
        0.0,
    )
    assert drain(upstream) == ["u1"]
    upstream.flush(0.0, heartbeat_due=False)
    outbox, inbox = connected()
    send_all(outbox, "m0", upstream=(upstream, "u1"))
    assert outbox.unfinished() == 1
    wire(outbox.dispatch(0.0), inbox, OUT_KEY, 0.0)
    assert drain(inbox) == ["m0"]
    inbox.done("m0")
    sends = inbox.flush(0.1, heartbeat_due=False)
    assert acks(sends) == [(OUT_KEY, [4, ["m0"], ["m0"]])]
    wire(sends, outbox, IN_KEY, 0.1)
    assert outbox.unfinished() == 0 and outbox.entries == {}
    assert acks(upstream.flush(0.1, heartbeat_due=False)) == [((0, b"prod"), [4, [], ["u1"]])]  # custody passed on


def test_a_duplicate_is_acknowledged_again_and_never_delivered_twice(metric):
    outbox, inbox = connected()
    send_all(outbox, "m0")
    sends = outbox.dispatch(0.0)
    before = metric("rlbus_bus_duplicates_total", topic=TOPIC)
    wire(sends, inbox, OUT_KEY, 0.0)
    wire(sends, inbox, OUT_KEY, 0.1)  # the same frames again (a re-send): held, not delivered
    assert drain(inbox) == ["m0"]
    assert acks(inbox.flush(0.1, heartbeat_due=False)) == [(OUT_KEY, [4, ["m0", "m0"], []])]
    inbox.done("m0")
    inbox.flush(0.2, heartbeat_due=False)
    wire(sends, inbox, OUT_KEY, 0.3)  # after done: taken and done again at once
    assert drain(inbox) == []
    assert acks(inbox.flush(0.3, heartbeat_due=False)) == [(OUT_KEY, [4, ["m0"], ["m0"]])]
    assert metric("rlbus_bus_duplicates_total", topic=TOPIC) - before == 2


def test_an_unacknowledged_message_is_re_sent_after_the_ack_timeout(metric):
    outbox, _inbox = connected()
    send_all(outbox, "m0", "m1")
    assert data_ids(outbox.dispatch(0.0)) == ["m0", "m1"]  # lost on the way: never acknowledged
    before = metric("rlbus_bus_redelivered_total", topic=TOPIC, reason="ack_timeout")
    outbox.check_deadlines(4.0, ack_timeout_s=5.0)
    assert outbox.dispatch(4.0) == []
    outbox.check_deadlines(5.5, ack_timeout_s=5.0)
    assert data_ids(outbox.dispatch(5.5)) == ["m0", "m1"]
    assert metric("rlbus_bus_redelivered_total", topic=TOPIC, reason="ack_timeout") - before == 2


@pytest.mark.parametrize("how", ["goodbye", "silent"])
def test_what_a_lost_peer_held_goes_to_another_peer(how):
    outbox, first = connected(window=1)
    second = make_inbox(window=1, session="in-2")
    send_all(outbox, "m0")
    sends = outbox.dispatch(0.0)
    assert [s.key for s in sends] == [IN_KEY]
    wire(sends, first, OUT_KEY, 0.0)
    wire(first.flush(0.0, heartbeat_due=False), outbox, IN_KEY, 0.0)  # taken (held, not done)
    second.dealer_links.append(0)
    wire(second.flush(1.0, heartbeat_due=True), outbox, IN2_KEY, 1.0)  # its hello: credit 1
    assert outbox.dispatch(1.0) == []  # with the first peer until it is lost
    if how == "goodbye":
        wire(first.goodbye(), outbox, IN_KEY, 2.0)
    else:
        wire(second.flush(10.5, heartbeat_due=True), outbox, IN2_KEY, 10.5)  # its heartbeat
        outbox.expire(11.0, dead_after_s=10.0)  # the first is silent since 0.0, the second not
    assert list(outbox.peers) == [IN2_KEY]
    resent = outbox.dispatch(11.0)
    assert [(s.key, i) for s, i in zip(resent, data_ids(resent))] == [(IN2_KEY, "m0")]
    wire(resent, second, OUT_KEY, 11.0)
    assert drain(second) == ["m0"]
    second.done("m0")
    wire(second.flush(11.1, heartbeat_due=False), outbox, IN2_KEY, 11.1)
    assert outbox.unfinished() == 0


def test_a_done_from_a_peer_it_was_never_sent_to_is_refused(metric):
    outbox, _inbox = connected()
    send_all(outbox, "m0")
    outbox.dispatch(0.0)
    before = metric("rlbus_bus_rejected_total", topic=TOPIC, reason="foreign_ack")
    wire([Send(OUT_KEY, [msgpack.packb([1, "A", "forger", [0, [], ["m0"]]])])], outbox, IN2_KEY, 0.1)
    assert outbox.unfinished() == 1
    assert metric("rlbus_bus_rejected_total", topic=TOPIC, reason="foreign_ack") - before == 1


def test_a_frame_set_that_could_not_go_out_is_pending_again_without_a_re_send(metric):
    outbox, inbox = connected(window=1)
    send_all(outbox, "m0")
    sends = outbox.dispatch(0.0)
    before = metric("rlbus_bus_redelivered_total", topic=TOPIC, reason="ack_timeout")
    outbox.unsent(sends[0])
    assert outbox.entries["m0"].sent_to == set()  # the peer never got it: it may not release it
    again = outbox.dispatch(0.1)
    assert data_ids(again) == ["m0"]
    outbox.check_deadlines(0.2, ack_timeout_s=5.0)
    assert metric("rlbus_bus_redelivered_total", topic=TOPIC, reason="ack_timeout") == before
    # an ack that could not go out keeps its releases for the next one
    wire(again, inbox, OUT_KEY, 0.1)
    assert drain(inbox) == ["m0"]
    inbox.done("m0")
    lost = inbox.flush(0.2, heartbeat_due=False)
    for send in lost:
        inbox.unsent(send)
    assert acks(inbox.flush(0.3, heartbeat_due=False)) == [(OUT_KEY, [1, [], ["m0"]])]


def test_send_blocks_at_capacity_until_a_consumer_takes_a_message():
    outbox, inbox = connected(window=4, capacity=2)
    send_all(outbox, "m0", "m1")
    assert not outbox.send(data_message(TOPIC, "m2"), timeout_s=0.05)  # full: not taken yet
    sends = outbox.dispatch(0.0)
    assert not outbox.send(data_message(TOPIC, "m2"), timeout_s=0.05)  # in flight is not taken
    wire(sends, inbox, OUT_KEY, 0.0)
    wire(inbox.flush(0.0, heartbeat_due=False), outbox, IN_KEY, 0.0)  # taken, not yet done
    assert outbox.send(data_message(TOPIC, "m2"), timeout_s=0)
    assert outbox.unfinished() == 3
    outbox.stop.set()
    send_all(outbox, "m3")  # one more fits (two taken), then a stopped outbox does not wait
    assert not outbox.send(data_message(TOPIC, "m4"))


def test_done_returns_credit_and_unknown_ids_are_ignored():
    outbox, inbox = connected(window=1)
    send_all(outbox, "m0", "m1")
    wire(outbox.dispatch(0.0), inbox, OUT_KEY, 0.0)
    wire(inbox.flush(0.0, heartbeat_due=False), outbox, IN_KEY, 0.0)
    assert acks(inbox.flush(0.0, heartbeat_due=False)) == []
    assert outbox.dispatch(0.0) == []  # window 1, one waiting in the inbox
    assert drain(inbox) == ["m0"]
    inbox.done("m0", "never-seen")
    sends = inbox.flush(0.1, heartbeat_due=False)
    assert acks(sends) == [(OUT_KEY, [1, [], ["m0"]])]
    wire(sends, outbox, IN_KEY, 0.1)
    assert data_ids(outbox.dispatch(0.1)) == ["m1"]
    assert list(outbox.entries) == ["m1"]


def test_boxes_refuse_bad_arguments():
    with pytest.raises(ValueError, match="not a data topic"):
        Inbox("control", ACCEPT[TOPIC], 1, session="s")
    with pytest.raises(ValueError, match="window"):
        make_inbox(window=0)
    with pytest.raises(ValueError, match="capacity"):
        make_outbox(capacity=0)
