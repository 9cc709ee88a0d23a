"""At-least-once delivery with custody (:mod:`bus.courier`) over real ZeroMQ and real processes.

Both socket patterns of the data topics are exercised: the sender binds a ROUTER and receivers
connect DEALERs (``prompts``, ``rollouts``, ``batches``), or the receiver binds a ROUTER and
senders connect DEALERs (``scored``). Each :class:`bus.courier.Courier` stands for one process
(its own session); peers that must die for real are child processes (``python -m
reliable_peer``) that the tests SIGKILL. Timings: heartbeats every 50 ms, a peer silent for
0.6 s is dead (:data:`reliable_peer.FAST`). Every wait is bounded; nothing asserts a duration.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from bus.courier import Courier
from bus.envelope import MAX_ENVELOPE_BYTES, MAX_IDS_PER_ACK, MAX_ID_CHARS
from bus.inbox import Inbox
from bus.messages import MicroBatch, Prompt, RunDone, ScoredGroup
from bus.outbox import Outbox
from bus.topics import TOPICS
from reliable_peer import ACCEPT, FAST, PeerProcess, RawPeer, data_message, envelope, frames_of

REDELIVERED = "rlbus_bus_redelivered_total"
REJECTED = "rlbus_bus_rejected_total"
DUPLICATES = "rlbus_bus_duplicates_total"
PEER_DEATHS = "rlbus_bus_peer_deaths_total"
QUEUED = "rlbus_bus_queued_messages"
WAIT_S = 5.0
"""Longest wait for something that should happen, seconds."""
QUIET_S = 0.3
"""How long "nothing more arrives" is watched, seconds."""


def receiver_binds(topic: str) -> bool:
    """True where the receiving side of ``topic`` binds (a ROUTER): ``scored``."""
    return TOPICS[topic].recv_type == zmq.ROUTER


def open_hop(
    sender: Courier, receiver: Courier, topic: str, ep: str, *, window: int | None = None, capacity: int | None = None
) -> tuple[Outbox, Inbox]:
    """One hop of ``topic`` between two couriers, bound and connected as the topic table says."""
    binds = receiver_binds(topic)
    inbox = receiver.receiver(topic, ep, bind=binds, accept=ACCEPT[topic], window=window)
    outbox = sender.sender(topic, ep, bind=not binds, capacity=capacity)
    return outbox, inbox


def receive(inbox: Inbox, n: int, *, done: bool = True, timeout_s: float = WAIT_S) -> list[str]:
    """The ids of the next ``n`` messages (each released at once when ``done``); fails on a gap."""
    ids = []
    for _ in range(n):
        msg = inbox.recv(timeout_s=timeout_s)
        assert msg is not None, f"only {len(ids)} of {n} messages arrived: {ids}"
        ids.append(msg.id)
        if done:
            inbox.done(msg.id)
    return ids


def total(metric, name: str, topic: str, reasons: tuple[str, ...]) -> float:
    return sum(metric(name, topic=topic, reason=r) for r in reasons)


DEATH_REASONS = ("silent", "unreachable", "goodbye", "restarted")


def free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def spawn(tmp_path: Path):
    """``spawn(*args)`` -> a :class:`reliable_peer.PeerProcess`; all are closed (or reaped) at teardown."""
    procs: list[PeerProcess] = []

    def make(*args: str) -> PeerProcess:
        procs.append(PeerProcess(list(args), tmp_path / f"peer-{len(procs)}.log"))
        return procs[-1]

    yield make
    for proc in procs:
        proc.close()


# -- the happy path ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "topic, transport",
    [
        ("prompts", "ipc"),
        ("rollouts", "ipc"),
        ("scored", "ipc"),
        ("batches", "ipc"),
        ("prompts", "tcp"),
        ("scored", "tcp"),
    ],
)
def test_delivers_in_order_and_finishes(topic, transport, couriers, endpoint, metric, wait_until):
    n = 300
    ep = endpoint(topic) if transport == "ipc" else free_tcp_endpoint()
    outbox, inbox = open_hop(couriers(), couriers(), topic, ep)
    ids = [f"{topic}-{i}" for i in range(n)]
    duplicates = metric(DUPLICATES, topic=topic)
    redelivered = total(metric, REDELIVERED, topic, (*DEATH_REASONS, "ack_timeout"))
    sent: list[bool] = []
    sender = threading.Thread(
        target=lambda: sent.extend(outbox.send(data_message(topic, i), timeout_s=10) for i in ids)
    )
    sender.start()  # more than the outbox holds: send() blocks on credit while we receive

    got = receive(inbox, n)
    sender.join(timeout=WAIT_S)
    assert sent == [True] * n
    assert got == ids  # every message, once, in order
    wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "every message done")
    assert inbox.recv(timeout_s=QUIET_S) is None
    assert metric(DUPLICATES, topic=topic) == duplicates
    assert total(metric, REDELIVERED, topic, (*DEATH_REASONS, "ack_timeout")) == redelivered


def test_full_message_arrives_intact(couriers, endpoint, micro_batch, assert_same_message):
    outbox, inbox = open_hop(couriers(), couriers(), "batches", endpoint("batches"))
    big = micro_batch(num_tokens=100_000)  # ~1.3 MB of array frames, zero-copy
    assert outbox.send(big, timeout_s=WAIT_S)
    got = inbox.recv(timeout_s=WAIT_S)
    assert got is not None
    assert_same_message(got, big)


# -- credit and backpressure ---------------------------------------------------------------------


@pytest.mark.parametrize("window, capacity", [(None, None), (3, 5)])
def test_credit_bounds_what_a_stalled_receiver_gets(window, capacity, couriers, endpoint, metric, wait_until):
    outbox, inbox = open_hop(couriers(), couriers(), "batches", endpoint("batches"), window=window, capacity=capacity)
    w, c = inbox.window, outbox.capacity  # defaults: the topic's bound (2 and 2 on batches)
    assert (w, c) == ((window, capacity) if window else (TOPICS["batches"].hwm,) * 2)
    handed = 0
    while outbox.send(data_message("batches", f"b-{handed}"), timeout_s=1.5):  # the receiver never recv()s
        handed += 1
        assert handed <= w + c + 10, "send() never blocked"
    print(f"window {w} + capacity {c}: send() took {handed} messages, then timed out")
    assert handed == w + c  # window messages wait in the receiver, capacity in the outbox
    wait_until(lambda: metric(QUEUED, topic="batches", queue="inbox") == w, WAIT_S, "the inbox holds its window")
    assert metric(QUEUED, topic="batches", queue="outbox_not_taken") == c
    assert metric(QUEUED, topic="batches", queue="outbox_unfinished") == w + c
    assert outbox.unfinished() == w + c

    assert receive(inbox, w + c) == [f"b-{i}" for i in range(w + c)]
    assert inbox.recv(timeout_s=QUIET_S) is None  # the refused message was never sent
    wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "all done")
    assert outbox.send(data_message("batches", "after"), timeout_s=1.5)  # room again
    assert receive(inbox, 1) == ["after"]


def test_credit_routes_around_a_stalled_receiver(couriers, endpoint, wait_until):
    ep = endpoint("prompts")
    outbox = couriers().sender("prompts", ep, bind=True)
    stalled = couriers().receiver("prompts", ep, bind=False, accept=(Prompt,))
    active = couriers().receiver("prompts", ep, bind=False, accept=(Prompt,))
    # (peeking at the I/O thread's peer table, read-only: both must have said hello before we send)
    wait_until(lambda: len(outbox.peers) == 2, WAIT_S, "both receivers known to the sender")
    n, w = 24, stalled.window
    ids = [f"p-{i}" for i in range(n)]
    sent: list[bool] = []
    sender = threading.Thread(
        target=lambda: sent.extend(outbox.send(data_message("prompts", i), timeout_s=10) for i in ids)
    )
    sender.start()
    got_active = receive(active, n - w)
    sender.join(timeout=WAIT_S)
    assert sent == [True] * n
    assert active.recv(timeout_s=QUIET_S) is None
    got_stalled = receive(stalled, w, timeout_s=0.5)  # exactly its credit was waiting for it
    assert stalled.recv(timeout_s=0) is None
    assert sorted(got_active + got_stalled) == sorted(ids)
    wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "all done")


def test_credit_stays_bounded_after_a_sender_restarts(couriers, endpoint, spawn, metric, wait_until):
    ep = endpoint("prompts")
    inbox = couriers().receiver("prompts", ep, bind=False, accept=(Prompt,))
    w = inbox.window
    old = spawn("send", "--topic", "prompts", "--endpoint", ep, "--bind", "--count", str(2 * w), "--prefix", "old")
    wait_until(lambda: metric(QUEUED, topic="prompts", queue="inbox") == w, WAIT_S, "the old sender's window taken")
    old.kill()
    new = spawn("send", "--topic", "prompts", "--endpoint", ep, "--bind", "--count", str(4 * w), "--prefix", "new")
    wait_until(lambda: metric(QUEUED, topic="prompts", queue="inbox") == 2 * w, WAIT_S, "the new sender's window taken")
    assert receive(inbox, w, done=False) == [f"old-{i}" for i in range(w)]  # the dead sender's messages
    time.sleep(QUIET_S)  # the new sender would get any credit we granted meanwhile
    # consuming the dead sender's messages grants its successor nothing: its window is still full
    assert metric(QUEUED, topic="prompts", queue="inbox") == w
    assert receive(inbox, 4 * w) == [f"new-{i}" for i in range(4 * w)]  # and it goes on normally
    new.expect("unfinished 0")


# -- custody: nothing lost when a holder dies ----------------------------------------------------


def test_killed_receiver_messages_reach_another(couriers, endpoint, spawn, metric, wait_until):
    ep = endpoint("prompts")
    outbox = couriers().sender("prompts", ep, bind=True)
    doomed = spawn("recv", "--topic", "prompts", "--endpoint", ep)  # takes everything, releases nothing
    ids = [f"p-{i}" for i in range(12)]
    for msg_id in ids:
        assert outbox.send(data_message("prompts", msg_id), timeout_s=WAIT_S)
    held = [doomed.expect("got") for _ in ids]
    assert held == ids and outbox.unfinished() == len(ids)
    before = total(metric, REDELIVERED, "prompts", DEATH_REASONS)

    doomed.kill()
    heir = couriers().receiver("prompts", ep, bind=False, accept=(Prompt,))
    assert receive(heir, len(ids)) == ids  # every held message, once, oldest first
    wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "all done at the heir")
    assert heir.recv(timeout_s=QUIET_S) is None
    assert total(metric, REDELIVERED, "prompts", DEATH_REASONS) == before + len(ids)


def test_restarted_binder_gets_the_senders_unfinished_messages(couriers, endpoint, spawn, wait_until):
    ep = endpoint("scored")  # the packer's pattern: it binds a ROUTER, reward workers connect DEALERs
    first = spawn("recv", "--topic", "scored", "--endpoint", ep, "--bind")  # holds what it gets
    senders = [couriers().sender("scored", ep, bind=False) for _ in range(2)]
    early = [[f"s{k}-{i}" for i in range(5)] for k in range(2)]
    for outbox, ids in zip(senders, early):
        for msg_id in ids:
            assert outbox.send(data_message("scored", msg_id), timeout_s=WAIT_S)
    held = {first.expect("got") for _ in range(10)}
    assert held == set(early[0] + early[1])

    first.kill()
    second = spawn("recv", "--topic", "scored", "--endpoint", ep, "--bind", "--done")  # same endpoint
    late = [[f"s{k}-{i}" for i in range(5, 8)] for k in range(2)]
    for outbox, ids in zip(senders, late):
        for msg_id in ids:
            assert outbox.send(data_message("scored", msg_id), timeout_s=WAIT_S)
    got = [second.expect("got") for _ in range(16)]
    assert sorted(got) == sorted(early[0] + early[1] + late[0] + late[1])  # each once
    for outbox in senders:
        wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "the restarted receiver released them all")
    assert second.next_line(QUIET_S) is None


@pytest.mark.parametrize("topic", ["scored", "prompts"])
def test_dead_sender_does_not_break_the_receiver(topic, couriers, endpoint, spawn, metric, wait_until):
    ep = endpoint(topic)
    binds = receiver_binds(topic)
    inbox = couriers().receiver(topic, ep, bind=binds, accept=ACCEPT[topic])
    sender_args = ["send", "--topic", topic, "--endpoint", ep, *([] if binds else ["--bind"])]
    doomed = spawn(*sender_args, "--count", "3", "--prefix", "dead")
    got = receive(inbox, 3, done=False)
    assert got == ["dead-0", "dead-1", "dead-2"]
    deaths = total(metric, PEER_DEATHS, topic, DEATH_REASONS)

    doomed.kill()
    wait_until(lambda: total(metric, PEER_DEATHS, topic, DEATH_REASONS) > deaths, WAIT_S, "the sender declared dead")
    inbox.done(*got)  # releasing messages of a dead sender is harmless
    successor = spawn(*sender_args, "--count", "3", "--prefix", "alive")  # prompts: binds the same endpoint again
    assert receive(inbox, 3) == ["alive-0", "alive-1", "alive-2"]
    successor.expect("unfinished 0")  # our done() reached it
    assert inbox.recv(timeout_s=QUIET_S) is None


def test_goodbye_resends_at_once(couriers, endpoint, metric):
    # Silence and ack timeouts far beyond the waits here: only the goodbye can move the messages.
    slow = dict(dead_after_s=60.0, ack_timeout_s=60.0)
    ep = endpoint("prompts")
    outbox = couriers(**slow).sender("prompts", ep, bind=True)
    leaving = couriers(**slow)
    ids = ["p-0", "p-1", "p-2"]
    inbox = leaving.receiver("prompts", ep, bind=False, accept=(Prompt,))
    for msg_id in ids:
        assert outbox.send(data_message("prompts", msg_id), timeout_s=WAIT_S)
    assert receive(inbox, 3, done=False) == ids  # held
    staying = couriers(**slow).receiver("prompts", ep, bind=False, accept=(Prompt,))
    before = {r: metric(REDELIVERED, topic="prompts", reason=r) for r in DEATH_REASONS}

    leaving.close()  # graceful: says goodbye
    assert receive(staying, 3) == ids
    after = {r: metric(REDELIVERED, topic="prompts", reason=r) for r in DEATH_REASONS}
    assert after["goodbye"] == before["goodbye"] + 3
    assert after["silent"] == before["silent"]


def test_unacknowledged_message_is_resent_after_ack_timeout(couriers, endpoint, metric, wait_until):
    ep = endpoint("prompts")
    outbox = couriers(ack_timeout_s=0.3).sender("prompts", ep, bind=True)
    broken = couriers().receiver("prompts", ep, bind=False, accept=(MicroBatch,))  # rejects prompts: never acks
    resent = metric(REDELIVERED, topic="prompts", reason="ack_timeout")
    refused = metric(REJECTED, topic="prompts", reason="unexpected_type")
    assert outbox.send(data_message("prompts", "p-0"), timeout_s=WAIT_S)

    wait_until(
        lambda: metric(REDELIVERED, topic="prompts", reason="ack_timeout") >= resent + 2,
        WAIT_S,
        "re-sent after each ack timeout",
    )
    wait_until(
        lambda: metric(REJECTED, topic="prompts", reason="unexpected_type") >= refused + 3,
        WAIT_S,
        "and it came each time",
    )  # the re-send arrives just after its ack_timeout is counted
    assert broken.recv(timeout_s=0) is None
    assert outbox.unfinished() == 1  # kept all along
    working = couriers().receiver("prompts", ep, bind=False, accept=(Prompt,))
    assert receive(working, 1) == ["p-0"]  # a working receiver gets it in the end
    wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "done")


# -- dedupe and custody chains -------------------------------------------------------------------


def test_idle_holder_stays_alive_for_every_sender(couriers, endpoint, metric, wait_until):
    # The packer holds scored groups for long: every sender must keep hearing from it meanwhile.
    ep = endpoint("scored")
    inbox = couriers().receiver("scored", ep, bind=True, accept=(ScoredGroup,))
    senders = [couriers().sender("scored", ep, bind=False) for _ in range(3)]
    for k, outbox in enumerate(senders):
        assert outbox.send(data_message("scored", f"g-{k}"), timeout_s=WAIT_S)
    held = receive(inbox, 3, done=False)
    resent = total(metric, REDELIVERED, "scored", (*DEATH_REASONS, "ack_timeout"))
    time.sleep(3 * FAST["dead_after_s"])  # idle, far longer than the silence that means dead
    assert total(metric, REDELIVERED, "scored", (*DEATH_REASONS, "ack_timeout")) == resent
    assert inbox.recv(timeout_s=0) is None
    inbox.done(*held)
    for outbox in senders:
        wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "released")


def test_same_id_from_two_senders_comes_out_once(couriers, endpoint, metric, wait_until):
    ep = endpoint("scored")
    inbox = couriers().receiver("scored", ep, bind=True, accept=(ScoredGroup,))
    first, second = (couriers().sender("scored", ep, bind=False) for _ in range(2))
    dupes = metric(DUPLICATES, topic="scored")
    msg = data_message("scored", "g-dup")

    assert first.send(msg, timeout_s=WAIT_S)
    assert receive(inbox, 1, done=False) == ["g-dup"]
    assert second.send(msg, timeout_s=WAIT_S)
    wait_until(lambda: metric(DUPLICATES, topic="scored") == dupes + 1, WAIT_S, "the copy dropped as a duplicate")
    assert inbox.recv(timeout_s=QUIET_S) is None
    assert first.unfinished() == second.unfinished() == 1
    inbox.done("g-dup")  # releases both senders
    wait_until(lambda: first.unfinished() == second.unfinished() == 0, WAIT_S, "both senders released")

    late = couriers().sender("scored", ep, bind=False)  # a copy after done: released at once, never delivered
    assert late.send(msg, timeout_s=WAIT_S)
    wait_until(lambda: late.unfinished() == 0, WAIT_S, "the late copy released")
    assert metric(DUPLICATES, topic="scored") == dupes + 2
    assert inbox.recv(timeout_s=QUIET_S) is None


def test_custody_passes_hop_by_hop(couriers, endpoint, wait_until):
    a, b, c = couriers(), couriers(), couriers()
    a_out = a.sender("prompts", endpoint("prompts"), bind=True)  # A -> B: prompts
    b_in = b.receiver("prompts", endpoint("prompts"), bind=False, accept=(Prompt,))
    c_in = c.receiver("scored", endpoint("scored"), bind=True, accept=(ScoredGroup,))  # B -> C: scored
    b_out = b.sender("scored", endpoint("scored"), bind=False)
    for msg_id in ("p-0", "p-1"):
        assert a_out.send(data_message("prompts", msg_id), timeout_s=WAIT_S)
    inputs = receive(b_in, 2, done=False)
    result = data_message("scored", "g-0")
    for input_id in inputs:  # both inputs end up in the same result: one copy travels, both are released
        assert b_out.send(result, upstream=(b_in, input_id), timeout_s=WAIT_S)

    assert receive(c_in, 1, done=False) == ["g-0"]
    assert c_in.recv(timeout_s=QUIET_S) is None
    assert a_out.unfinished() == 2 and b_out.unfinished() == 1  # C holds the result: nobody is released
    c_in.done("g-0")
    wait_until(lambda: b_out.unfinished() == 0, WAIT_S, "B released by C")
    wait_until(lambda: a_out.unfinished() == 0, WAIT_S, "A released through B")


def test_receiver_connects_to_every_sender_even_later_ones(couriers, endpoint, wait_until):
    # A reward worker connects to every rollouts endpoint up to producers.max_replicas; some have no producer yet.
    eps = [endpoint(f"rollouts-{i}") for i in range(3)]
    inbox = couriers().receiver("rollouts", eps, bind=False, accept=ACCEPT["rollouts"])
    outboxes = [couriers().sender("rollouts", eps[i], bind=True) for i in (0, 2)]
    for k, outbox in enumerate(outboxes):
        assert outbox.send(data_message("rollouts", f"r{k}"), timeout_s=WAIT_S)
    assert sorted(receive(inbox, 2)) == ["r0", "r1"]
    later = couriers().sender("rollouts", eps[1], bind=True)  # busctl scale: a producer appears
    assert later.send(data_message("rollouts", "r-later"), timeout_s=WAIT_S)
    assert receive(inbox, 1) == ["r-later"]
    for outbox in (*outboxes, later):
        wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "done")


# -- hostile input -------------------------------------------------------------------------------

_rng = random.Random(99)

ENVELOPE_CASES: dict[str, tuple[str, list[bytes]]] = {
    "random_bytes": ("envelope", [_rng.randbytes(64), _rng.randbytes(9)]),
    "empty_frame": ("envelope", [b""]),
    "not_msgpack": ("envelope", [b"\xc1\xc1"]),
    "trailing_bytes": ("envelope", [envelope("H", "s", None) + b"\x00"]),
    "truncated": ("envelope", [envelope("H", "sess", None)[:-3]]),
    "not_a_list": ("envelope", [msgpack.packb({"kind": "D"})]),
    "short_list": ("envelope", [msgpack.packb([1, "H", "s"])]),
    "long_list": ("envelope", [msgpack.packb([1, "H", "s", None, 0])]),
    "wrong_protocol": ("envelope", [envelope("H", "s", None, protocol=2)]),
    "protocol_as_string": ("envelope", [envelope("H", "s", None, protocol="1")]),
    "unknown_kind": ("envelope", [envelope("X", "s", None)]),
    "kind_as_bytes": ("envelope", [envelope(b"H", "s", None)]),
    "empty_session": ("envelope", [envelope("H", "", None)]),
    "session_not_a_string": ("envelope", [envelope("H", 7, None)]),
    "session_too_long": ("envelope", [envelope("H", "s" * (MAX_ID_CHARS + 1), None)]),
    "ext_type": ("envelope", [envelope("H", "s", msgpack.ExtType(1, b"pickle"))]),
    "huge_declared_str": ("envelope", [b"\x94\x01\xa1H\xdb\xff\xff\xff\xff" + b"abc"]),
    "huge_declared_bin": ("envelope", [b"\x94\x01\xa1H\xc6\xff\xff\xff\xff" + b"abc"]),
    "huge_declared_array": ("envelope", [b"\xdd\xff\xff\xff\xff\x01\xa1H"]),
    "huge_declared_map": ("envelope", [b"\x94\x01\xa1H\xa1s\xdf\xff\xff\xff\xff"]),
    "too_large": ("too_large", [b"\x00" * (MAX_ENVELOPE_BYTES + 1)]),
}
"""Broken envelopes: rejected by every box, receiver or sender."""

INBOX_CASES: dict[str, tuple[str, list[bytes]]] = {
    "ack_to_a_receiver": ("wrong_direction", [envelope("A", "s", [4, [], []])]),
    "goodbye_to_a_receiver": ("wrong_direction", [envelope("B", "s", None)]),
    "data_without_id": ("envelope", [envelope("D", "s", None), *frames_of(data_message("scored", "x"))]),
    "data_empty_id": ("envelope", [envelope("D", "s", ""), *frames_of(data_message("scored", "x"))]),
    "data_id_not_a_string": ("envelope", [envelope("D", "s", 7), *frames_of(data_message("scored", "x"))]),
    "data_without_message": ("frames", [envelope("D", "s", "x")]),
    "data_bad_header": ("header", [envelope("D", "s", "x"), b"\xc1"]),
    "data_of_another_type": (
        "unexpected_type",
        [envelope("D", "s", "r"), *frames_of(RunDone(id="r", step=1, reason="x"))],
    ),
    "data_id_mismatch": ("id_mismatch", [envelope("D", "s", "other"), *frames_of(data_message("scored", "x"))]),
}
"""Envelopes a receiver must refuse (its socket gets ``D`` only, and the message must be good)."""

OUTBOX_CASES: dict[str, tuple[str, list[bytes]]] = {
    "data_to_a_sender": ("wrong_direction", [envelope("D", "s", "x"), *frames_of(data_message("scored", "x"))]),
    "heartbeat_to_a_sender": ("wrong_direction", [envelope("H", "s", None)]),
    "ack_negative_credit": ("envelope", [envelope("A", "s", [-1, [], []])]),
    "ack_huge_credit": ("envelope", [envelope("A", "s", [1_000_001, [], []])]),
    "ack_bool_credit": ("envelope", [envelope("A", "s", [True, [], []])]),
    "ack_float_credit": ("envelope", [envelope("A", "s", [1.5, [], []])]),
    "ack_short": ("envelope", [envelope("A", "s", [1, []])]),
    "ack_ids_not_a_list": ("envelope", [envelope("A", "s", [1, "x", []])]),
    "ack_id_not_a_string": ("envelope", [envelope("A", "s", [1, [], [3]])]),
    "ack_nested_ids": ("envelope", [envelope("A", "s", [1, [["x"]], []])]),
    "ack_too_many_ids": ("envelope", [envelope("A", "s", [0, ["i"] * (MAX_IDS_PER_ACK + 1), []])]),
}
"""Envelopes a sender must refuse (its socket gets ``A`` and ``B`` only, with a well-formed payload)."""


class BoxUnderAttack:
    """One box of each kind with a raw hostile peer on its socket, and a check that it still works.

    ``router_inbox``: the packer's ``scored`` inbox (ROUTER) and a raw DEALER;
    ``router_outbox``: the prompt source's ``prompts`` outbox (ROUTER) and a raw DEALER;
    ``dealer_inbox``: a producer's ``prompts`` inbox (DEALER) connected to a raw ROUTER;
    ``dealer_outbox``: a reward worker's ``scored`` outbox (DEALER) connected to a raw ROUTER.
    """

    def __init__(self, kind: str, couriers, ctx: zmq.Context, endpoint) -> None:
        self.kind = kind
        self.couriers = couriers
        self.topic = "scored" if kind in ("router_inbox", "dealer_outbox") else "prompts"
        self.ep = endpoint(self.topic)
        self.inbound = kind.endswith("inbox")
        courier = couriers()
        if kind == "router_inbox":
            self.box = courier.receiver("scored", self.ep, bind=True, accept=(ScoredGroup,))
            self.raw = RawPeer(ctx, zmq.DEALER, self.ep)
        elif kind == "router_outbox":
            self.box = courier.sender("prompts", self.ep, bind=True)
            self.raw = RawPeer(ctx, zmq.DEALER, self.ep)
        else:
            self.raw = RawPeer(ctx, zmq.ROUTER, self.ep)
            if kind == "dealer_inbox":
                self.box = courier.receiver("prompts", self.ep, bind=False, accept=(Prompt,))
            else:
                self.box = courier.sender("scored", self.ep, bind=False)
            self.raw.wait_peer()  # the box says hello (inbox) or heartbeats (outbox)

    def cases(self) -> dict[str, tuple[str, list[bytes]]]:
        extra = INBOX_CASES if self.inbound else OUTBOX_CASES
        if self.topic == "prompts" and self.inbound:  # it takes prompts: a scored group is another type there
            extra = {k: v for k, v in extra.items() if k != "data_id_mismatch"} | {
                "data_id_mismatch": (
                    "id_mismatch",
                    [envelope("D", "s", "other"), *frames_of(data_message("prompts", "x"))],
                ),
                "data_of_another_type": (
                    "unexpected_type",
                    [envelope("D", "s", "g"), *frames_of(data_message("scored", "g"))],
                ),
            }
        return {**ENVELOPE_CASES, **extra}

    def still_works(self, wait_until) -> None:
        """A real exchange through the box after the attack."""
        msg = data_message(self.topic, "after-attack")
        if self.kind == "router_inbox":
            assert self.couriers().sender("scored", self.ep, bind=False).send(msg, timeout_s=WAIT_S)
            assert receive(self.box, 1) == ["after-attack"]
        elif self.kind == "router_outbox":
            inbox = self.couriers().receiver("prompts", self.ep, bind=False, accept=(Prompt,))
            assert self.box.send(msg, timeout_s=WAIT_S)
            assert receive(inbox, 1) == ["after-attack"]
            wait_until(lambda: self.box.unfinished() == 0, WAIT_S, "done")
        elif self.kind == "dealer_inbox":  # the raw ROUTER speaks the protocol by hand
            self.raw.send_data(msg)
            self.raw.wait_for("A", WAIT_S, lambda p: "after-attack" in p[1])  # taken
            assert receive(self.box, 1) == ["after-attack"]
            self.raw.wait_for("A", WAIT_S, lambda p: "after-attack" in p[2])  # done
        else:
            assert self.box.send(msg, timeout_s=WAIT_S)
            self.raw.send_ack(1)  # credit for one message
            assert self.raw.wait_for("D", WAIT_S) == "after-attack"
            self.raw.send_ack(0, taken=["after-attack"], done=["after-attack"])
            wait_until(lambda: self.box.unfinished() == 0, WAIT_S, "released by the hand-made ack")


@pytest.mark.parametrize("kind", ["router_inbox", "router_outbox", "dealer_inbox", "dealer_outbox"])
def test_hostile_frames_are_counted_and_the_box_keeps_working(kind, couriers, ctx, endpoint, metric, wait_until):
    attacked = BoxUnderAttack(kind, couriers, ctx, endpoint)
    try:
        for name, (reason, frames) in attacked.cases().items():
            before = metric(REJECTED, topic=attacked.topic, reason=reason)
            attacked.raw.send(frames)
            wait_until(
                lambda reason=reason, before=before: (
                    metric(REJECTED, topic=attacked.topic, reason=reason) == before + 1
                ),
                WAIT_S,
                f"{name}: counted as {reason}",
            )
        attacked.still_works(wait_until)
    finally:
        attacked.raw.close()


@pytest.mark.parametrize("kind", ["router_outbox", "dealer_outbox"])
def test_forged_acks_never_release_a_held_message(kind, couriers, ctx, endpoint, metric, wait_until):
    """Only a peer that was sent a message can release it: a forged ``done`` is refused."""
    topic = "prompts" if kind == "router_outbox" else "scored"
    forger_ep = endpoint("forger")
    binds = not receiver_binds(topic)
    real_ep = endpoint(topic)
    courier = couriers()
    if binds:  # the forger connects to the outbox's ROUTER like any receiver
        outbox = courier.sender(topic, real_ep, bind=True)
        forger = RawPeer(ctx, zmq.DEALER, real_ep, session="forger")
    else:  # the outbox connects to the real receiver and to the forger's ROUTER
        forger = RawPeer(ctx, zmq.ROUTER, forger_ep, session="forger")
        outbox = courier.sender(topic, [real_ep, forger_ep], bind=False)
        forger.wait_peer()
    holder = couriers().receiver(topic, real_ep, bind=not binds, accept=ACCEPT[topic])
    try:
        assert outbox.send(data_message(topic, "held"), timeout_s=WAIT_S)
        assert receive(holder, 1, done=False) == ["held"]
        before = metric(REJECTED, topic=topic, reason="foreign_ack")
        forger.send_ack(0, taken=["held"], done=["held"])
        wait_until(
            lambda: metric(REJECTED, topic=topic, reason="foreign_ack") == before + 1, WAIT_S, "forged ack counted"
        )
        assert outbox.unfinished() == 1  # still held for the real holder
        holder.done("held")
        wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "released by its holder")
    finally:
        forger.close()


def test_late_done_from_an_earlier_holder_is_accepted(couriers, ctx, endpoint, metric, wait_until):
    """A receiver slow to acknowledge: the message is re-sent elsewhere, and the first holder's
    late ``done`` still releases it (it was sent there: no ``foreign_ack``)."""
    ep = endpoint("prompts")
    outbox = couriers(ack_timeout_s=0.3).sender("prompts", ep, bind=True)
    slow = RawPeer(ctx, zmq.DEALER, ep, session="slow")
    try:
        slow.send_ack(1)  # hello with credit for one message
        assert outbox.send(data_message("prompts", "p-0"), timeout_s=WAIT_S)
        assert slow.wait_for("D", WAIT_S) == "p-0"  # ... and no acknowledgement for a while
        other = couriers().receiver("prompts", ep, bind=False, accept=(Prompt,))
        assert receive(other, 1, done=False) == ["p-0"]  # re-sent after the ack timeout
        foreign = metric(REJECTED, topic="prompts", reason="foreign_ack")
        slow.send_ack(0, taken=["p-0"], done=["p-0"])  # the first holder finishes after all
        wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "released by the first holder")
        assert metric(REJECTED, topic="prompts", reason="foreign_ack") == foreign
        other.done("p-0")  # the second holder's done is then a no-op
    finally:
        slow.close()


# -- API errors ----------------------------------------------------------------------------------


def test_courier_refuses_bad_arguments(ctx, couriers, endpoint):
    with pytest.raises(ValueError, match="dead_after_s"):
        Courier(ctx, heartbeat_s=0.5, dead_after_s=1.0)
    courier = couriers()
    with pytest.raises(ValueError, match="not a data topic"):
        courier.sender("control_pub", endpoint("x"), bind=False)
    with pytest.raises(ValueError, match="must connect"):
        courier.receiver("prompts", endpoint("p"), bind=True, accept=(Prompt,))
    with pytest.raises(ValueError, match="must bind"):
        courier.receiver("scored", endpoint("s"), bind=False, accept=(ScoredGroup,))
    with pytest.raises(ValueError, match="window"):
        courier.receiver("scored", endpoint("s"), bind=True, accept=(ScoredGroup,), window=-1)
    with pytest.raises(zmq.ZMQError):
        courier.receiver("scored", "tcp://256.0.0.1:1", bind=True, accept=(ScoredGroup,))
    # the courier still works after refusing
    outbox, inbox = open_hop(courier, couriers(), "scored", endpoint("scored"))
    assert outbox.send(data_message("scored", "ok"), timeout_s=WAIT_S)
    assert receive(inbox, 1) == ["ok"]


def test_close_twice_leaves_other_couriers_alone(ctx, couriers, endpoint):
    first = Courier(ctx, heartbeat_s=0.05, dead_after_s=0.6)
    first.close()
    outbox, inbox = open_hop(couriers(), couriers(), "scored", endpoint("scored"))  # may reuse its descriptors
    first.close()  # a second close must not touch them
    assert outbox.send(data_message("scored", "ok"), timeout_s=WAIT_S)
    assert receive(inbox, 1) == ["ok"]
