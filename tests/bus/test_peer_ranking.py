"""The outbox's choice of peer (:class:`bus.outbox.PeerRanking`) and the heartbeats it and the inbox
skip, on plain data (no sockets, as in ``test_inbox_outbox.py``).

- the ranking chooses exactly what the former scan of every peer chose (the peer with the most room
  ``free - untaken`` > 0, the least recently chosen or joined among equals), over random joins,
  leaves, credit changes and choices;
- an outbox spreads messages over peers with equal room in turn;
- a peer sent a frame within ``heartbeat_skip_s`` gets no heartbeat; an idle one still does.
"""

from __future__ import annotations

import collections
import random

import msgpack
import pytest

from bus.envelope import PeerKey, Send
from bus.outbox import PeerRanking
from test_inbox_outbox import IN2_KEY, IN_KEY, OUT_KEY, connected, data_ids, make_inbox, send_all, wire


def scan_choice(rooms: collections.OrderedDict[PeerKey, int]) -> PeerKey | None:
    """The former ``Outbox._pick_peer``: first peer (in rotation order) with the most room > 0,
    rotated to the end."""
    best, best_room = None, 0
    for key, room in rooms.items():
        if room > best_room:
            best, best_room = key, room
    if best is not None:
        rooms.move_to_end(best)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_ranking_chooses_what_the_scan_chose(seed):
    rng = random.Random(seed)
    rooms: collections.OrderedDict[PeerKey, int] = collections.OrderedDict()
    ranking = PeerRanking()
    names = [(0, f"p{i}".encode()) for i in range(12)]
    chosen = 0
    for _ in range(4000):
        op = rng.random()
        key = rng.choice(names)
        if op < 0.1 and key not in rooms:  # a peer joins (at the end of the rotation)
            rooms[key] = rng.randint(0, 4)
            ranking.update(key, rooms[key], touch=True)
        elif op < 0.15 and key in rooms:  # a peer is lost
            del rooms[key]
            ranking.remove(key)
        elif op < 0.45 and key in rooms:  # an ack: new credit, receipts taken (its turn unchanged)
            rooms[key] = rng.randint(-1, 5)
            ranking.update(key, rooms[key])
        else:  # dispatch one message
            want = scan_choice(rooms)
            got = ranking.best()
            assert got == want, f"scan chose {want}, ranking {got}"
            if got is not None:
                rooms[got] -= 1
                ranking.update(got, rooms[got], touch=True)
                chosen += 1
    assert chosen > 500  # the comparison covered many choices
    assert len(ranking._heap) <= PeerRanking.COMPACT_FACTOR * len(ranking._rank) + 64  # stale entries compacted


def test_outbox_takes_turns_among_equal_peers():
    outbox, first = connected(window=1)
    second = make_inbox(window=1, session="in-2")
    second.dealer_links.append(0)
    wire(second.flush(0.0, heartbeat_due=True), outbox, IN2_KEY, 0.0)
    send_all(outbox, "m0")
    sends = outbox.dispatch(0.0)
    assert [s.key for s in sends] == [IN_KEY]  # equal room: the one that joined first
    wire(sends, first, OUT_KEY, 0.1)
    assert first.recv(timeout_s=0).id == "m0"
    wire(first.flush(0.1, heartbeat_due=False), outbox, IN_KEY, 0.1)  # taken and consumed: room 1 again
    send_all(outbox, "m1", "m2")
    sends = outbox.dispatch(0.2)  # equal room again: the second's turn, then the first's
    assert [(s.key, i) for s, i in zip(sends, data_ids(sends))] == [(IN2_KEY, "m1"), (IN_KEY, "m2")]
    send_all(outbox, "m3")
    assert outbox.dispatch(0.3) == []  # nobody has room


def kinds(sends: list[Send]) -> list[tuple[PeerKey, str]]:
    return [(s.key, msgpack.unpackb(s.frames[0])[1]) for s in sends]


def test_no_heartbeat_to_a_peer_that_was_just_sent_a_frame():
    outbox, inbox = connected()
    wire(outbox.flush(0.0, heartbeat_due=True), inbox, OUT_KEY, 0.0)  # the inbox knows the outbox
    for box in (outbox, inbox):
        box.heartbeat_skip_s = 0.25
    assert kinds(outbox.flush(1.0, heartbeat_due=True)) == [(IN_KEY, "H")]  # never sent anything: beat
    assert kinds(inbox.flush(1.0, heartbeat_due=True)) == [(OUT_KEY, "A")]
    outbox.peers[IN_KEY].last_sent = inbox.peers[OUT_KEY].last_sent = 0.9  # as the courier marks a sent frame
    assert outbox.flush(1.0, heartbeat_due=True) == []
    assert inbox.flush(1.0, heartbeat_due=True) == []
    assert kinds(outbox.flush(1.2, heartbeat_due=True)) == [(IN_KEY, "H")]  # quiet for 0.3 s: beat again
    assert kinds(inbox.flush(1.2, heartbeat_due=True)) == [(OUT_KEY, "A")]
    inbox.peers[OUT_KEY].last_sent = 1.2
    send_all(outbox, "m0")
    wire(outbox.dispatch(1.3), inbox, OUT_KEY, 1.3)
    assert [k for _, k in kinds(inbox.flush(1.3, heartbeat_due=True))] == ["A"]  # the receipt ack, no extra beat
