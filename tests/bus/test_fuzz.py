"""Fuzz: >= 10,000 hostile messages into every kind of receiving socket rlbus uses.

The receiving sockets: a data topic's inbox, a ROUTER (the packer's ``scored``) or a DEALER
(``prompts``, ``rollouts``, ``batches``); a data topic's outbox socket, ROUTER or DEALER, which
receives acknowledgements; the control SUB and the hub's XSUB (and its XPUB, which hears from
subscribers); the supervisor's PULL. Each test sends :class:`fuzz.HostileEnvelopes` (data topics)
or :class:`fuzz.HostileMessages` (the others), every one invalid for the receiver under test,
over real ZeroMQ sockets, with valid messages in between, and checks that the receiver keeps
working, that the valid messages arrive in order, and that ``rlbus_bus_rejected_total`` of the
topic grew by exactly the number of hostile messages, reason by reason, with no ``decode``
reject (the decoder never raised anything but ``WireError``). An outbox must also keep every
message a real receiver holds, whatever acks it is sent. PUB/XPUB peers drop at the HWM, so
their senders wait for the receiver's counter after every chunk: nothing is lost unseen.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from typing import Callable

import msgpack
import pytest
import zmq
from prometheus_client import REGISTRY

from bus.codec import decode, encode
from bus.registry import MESSAGE_TYPES
from bus.messages import (
    ComponentHeartbeat,
    ComponentReady,
    GroupsDropped,
    Message,
    RunDone,
    ScoredGroup,
    TrainerStep,
)
from bus.topics import TOPICS
from fuzz import (
    ENVELOPE_MUTATIONS,
    INBOX_MUTATIONS,
    MUTATIONS,
    OUTBOX_MUTATIONS,
    HostileEnvelopes,
    HostileMessages,
    classify,
    classify_delivery,
    realistic_examples,
)
from reliable_peer import ACCEPT, RawPeer, data_message, envelope

N_HOSTILE = 10_000
VALID_EVERY = 2_000
"""One valid message follows every this many hostile ones (and one ends the stream)."""
CHUNK = 500
"""PUB senders send this many, then wait until the receiver has counted them (HWM 10,000)."""
DEADLINE_S = 30.0


def rejected(topic: str) -> Counter[str]:
    """``rlbus_bus_rejected_total{topic}`` by reason, from the default registry."""
    out: Counter[str] = Counter()
    for metric in REGISTRY.collect():
        if metric.name == "rlbus_bus_rejected":
            for s in metric.samples:
                if s.name == "rlbus_bus_rejected_total" and s.labels["topic"] == topic:
                    out[s.labels["reason"]] += int(s.value)
    return out


def delta(after: Counter[str], before: Counter[str]) -> Counter[str]:
    return Counter({r: after[r] - before[r] for r in after if after[r] != before[r]})


def stream(gen: HostileMessages, valid: Callable[[int], Message]):
    """(frames, valid_id or None): N_HOSTILE hostile messages, a valid one after every VALID_EVERY."""
    for i in range(N_HOSTILE):
        yield gen.next(), None
        if (i + 1) % VALID_EVERY == 0:
            msg = valid(i // VALID_EVERY)
            yield [bytes(memoryview(f)) for f in encode(msg)], msg.id


def renamed(msg: Message) -> Callable[[int], Message]:
    return lambda k: dataclasses.replace(msg, id=f"valid-{k}")


# -- the generator -----------------------------------------------------------------------------------


def test_generator_is_seeded_invalid_and_covers_every_mutation():
    a, b = HostileMessages(7, (ScoredGroup,)), HostileMessages(7, (ScoredGroup,))
    msgs = a.take(N_HOSTILE)
    assert msgs == b.take(N_HOSTILE)  # same seed, same stream
    assert msgs[:1000] != HostileMessages(8, (ScoredGroup,)).take(1000)

    reasons = Counter(classify(m, (ScoredGroup,)) for m in msgs)
    assert None not in reasons and reasons == a.reasons
    assert "decode" not in reasons  # the decoder only ever raises WireError
    assert set(reasons) >= {
        "header",
        "schema",
        "unknown_type",
        "frames",
        "dtype",
        "shape",
        "size",
        "field",
        "inconsistent",
        "unexpected_type",
    }
    assert set(a.mutations) == set(MUTATIONS)
    examples = realistic_examples()  # the material: one valid message of every registered type
    assert set(examples) == set(MESSAGE_TYPES)
    assert all(classify([bytes(memoryview(f)) for f in encode(m)], None) is None for m in examples.values())

    hub_side = HostileMessages(7, None)  # a receiver taking every type: no foreign_type mutation
    assert all(classify(m, None) for m in hub_side.take(2_000))
    assert "foreign_type" not in hub_side.mutations and "unexpected_type" not in hub_side.reasons


def _raw_map(d: dict, key: str, raw_value: bytes) -> bytes:
    """msgpack of map ``d`` (< 65536 keys) with the value of ``key`` replaced by raw bytes."""
    prefix = bytes([0x80 | len(d)]) if len(d) < 16 else b"\xde" + len(d).to_bytes(2, "big")
    return prefix + b"".join(msgpack.packb(k) + (raw_value if k == key else msgpack.packb(v)) for k, v in d.items())


def _scored_with_descriptor(key: str, raw_value: bytes) -> list[bytes]:
    """The realistic scored message, one key of its last array descriptor replaced by raw bytes."""
    frames = [bytes(memoryview(f)) for f in encode(realistic_examples()["scored"])]
    header = msgpack.unpackb(frames[0])
    *others, last = header["arrays"]
    arrays = (
        bytes([0x90 | len(header["arrays"])]) + b"".join(map(msgpack.packb, others)) + _raw_map(last, key, raw_value)
    )
    return [_raw_map(header, "arrays", arrays), *frames[1:]]


@pytest.mark.parametrize(
    "case, reason",
    [
        ("deep_schema", "schema"),  # repr() of these raised RecursionError (a "decode" reject)
        ("deep_name", "frames"),
        ("deep_dtype", "dtype"),
        ("deep_shape", "shape"),
        ("zero_length_ext", "header"),  # max_ext_len=0 let ext values of length 0 through
        ("bool_schema", "schema"),  # True == 1
        ("float_schema", "schema"),  # 1.0 == 1
    ],
)
def test_cases_found_by_fuzzing(case, reason):
    deep = b"\x91" * 1000 + b"\xc0"  # decodable (msgpack allows 1024 levels), too deep for repr()
    run_done = {"type": "run.done", "schema": 1, "id": "r", "step": 1, "reason": "x", "arrays": []}
    frames = {
        "deep_schema": lambda: [_raw_map(run_done, "schema", deep)],
        "deep_name": lambda: _scored_with_descriptor("name", deep),
        "deep_dtype": lambda: _scored_with_descriptor("dtype", deep),
        "deep_shape": lambda: _scored_with_descriptor("shape", deep),
        "zero_length_ext": lambda: [_raw_map(run_done, "reason", b"\xc7\x00\x05")],
        "bool_schema": lambda: [msgpack.packb({**run_done, "schema": True})],
        "float_schema": lambda: [msgpack.packb({**run_done, "schema": 1.0})],
    }[case]()
    assert classify(frames, None) == reason


def test_envelope_generator_is_seeded_invalid_and_covers_every_mutation():
    accept = (ScoredGroup,)
    a, b = HostileEnvelopes(5, "inbox", accept), HostileEnvelopes(5, "inbox", accept)
    msgs = a.take(N_HOSTILE)
    assert msgs == b.take(N_HOSTILE)  # same seed, same stream
    assert msgs[:1000] != HostileEnvelopes(6, "inbox", accept).take(1000)
    reasons = Counter(classify_delivery(m, "inbox", accept) for m in msgs)
    assert None not in reasons and reasons == a.reasons and "decode" not in reasons
    assert set(reasons) >= {
        "envelope",
        "too_large",
        "wrong_direction",
        "id_mismatch",
        "frames",
        "header",
        "unexpected_type",
        "field",
        "inconsistent",
    }
    assert set(a.mutations) == set(ENVELOPE_MUTATIONS) | set(INBOX_MUTATIONS)

    held = ["held-0", "held-1"]
    acks = HostileEnvelopes(5, "outbox", accept, held=held)
    msgs = acks.take(N_HOSTILE)
    assert Counter(classify_delivery(m, "outbox", accept, frozenset(held)) for m in msgs) == acks.reasons
    assert set(acks.reasons) == {"envelope", "too_large", "wrong_direction", "foreign_ack"}
    assert set(acks.mutations) == set(ENVELOPE_MUTATIONS) | set(OUTBOX_MUTATIONS)


# -- data topics: inboxes (ROUTER and DEALER) --------------------------------------------------------

INBOXES = {topic: ACCEPT[topic] for topic in TOPICS if TOPICS[topic].reliable}
"""Every data topic's inbox with its real accept tuple: ROUTERs (the packer's ``scored``, the
prompt source's ``outcomes``) and DEALERs (producers' ``prompts``, reward workers' ``rollouts``,
the trainer's ``batches``)."""


def wait_counted(topic: str, before: Counter[str], n: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while (counted := sum(delta(rejected(topic), before).values())) < n:
        assert time.monotonic() < deadline, f"{topic}: {counted} of {n} hostile messages counted"
        time.sleep(0.01)


@pytest.mark.parametrize("topic", list(INBOXES))
def test_reliable_inbox_rejects_fuzz(topic, couriers, ctx, endpoint):
    accept = INBOXES[topic]
    binds = TOPICS[topic].recv_type == zmq.ROUTER
    inbox = couriers().receiver(topic, endpoint(topic), bind=binds, accept=accept)
    raw = RawPeer(ctx, zmq.DEALER if binds else zmq.ROUTER, endpoint(topic), session="fuzzer")
    try:
        if not binds:
            raw.wait_peer()  # the inbox's DEALER says hello to its sender
        gen = HostileEnvelopes(100 + list(INBOXES).index(topic), "inbox", accept, session="fuzzer")
        valid = renamed(realistic_examples()[accept[0].TYPE])
        before = rejected(topic)
        want: list[str] = []
        for frames, valid_id in stream(gen, valid):
            if valid_id:  # a valid message in a valid envelope, from the same peer
                want.append(valid_id)
                frames = [envelope("D", "fuzzer", valid_id), *frames]
            raw.send(frames, timeout_s=DEADLINE_S)
        wait_counted(topic, before, N_HOSTILE)
        got = []
        while (msg := inbox.recv(timeout_s=0.5)) is not None:
            got.append(msg.id)
        still = couriers().sender(topic, endpoint(topic), bind=not binds) if binds else None
    finally:
        raw.close()

    assert got == want  # every valid message arrived, in order, and nothing hostile did
    assert len(want) == N_HOSTILE // VALID_EVERY
    assert delta(rejected(topic), before) == gen.reasons  # each hostile one counted once, by reason
    assert sum(gen.reasons.values()) == N_HOSTILE and "decode" not in gen.reasons
    if still is not None:  # and a real sender still gets through
        assert still.send(data_message(topic, "after-fuzz"), timeout_s=5)
        assert (msg := inbox.recv(timeout_s=5)) is not None and msg.id == "after-fuzz"


# -- data topics: outboxes (ROUTER and DEALER) receive acks -------------------------------------------


@pytest.mark.parametrize("binds", [True, False], ids=["router_outbox", "dealer_outbox"])
def test_outbox_rejects_fuzzed_acks_and_keeps_what_it_holds(binds, couriers, ctx, endpoint):
    topic = "prompts" if binds else "scored"  # the prompt source's ROUTER, a reward worker's DEALER
    accept = INBOXES[topic]
    real_ep, fuzz_ep = endpoint(topic), endpoint("fuzzer")
    if binds:  # the fuzzer connects to the outbox's ROUTER like a receiver
        outbox = couriers().sender(topic, real_ep, bind=True)
        raw = RawPeer(ctx, zmq.DEALER, real_ep, session="fuzzer")
    else:  # the outbox connects to the real receiver and to the fuzzer's ROUTER
        raw = RawPeer(ctx, zmq.ROUTER, fuzz_ep, session="fuzzer")
        outbox = couriers().sender(topic, [real_ep, fuzz_ep], bind=False)
    holder = couriers().receiver(topic, real_ep, bind=not binds, accept=accept)
    try:
        if not binds:
            raw.wait_peer()  # the outbox's heartbeat
        held = [f"held-{i}" for i in range(10)]
        for msg_id in held:
            assert outbox.send(data_message(topic, msg_id), timeout_s=5)
            assert (msg := holder.recv(timeout_s=5)) is not None and msg.id == msg_id  # taken, not done
        gen = HostileEnvelopes(200 + binds, "outbox", accept, held=held, session="fuzzer")
        before = rejected(topic)
        want: list[str] = []
        for frames, valid_id in stream(gen, lambda k: data_message(topic, f"valid-{k}")):
            if valid_id:  # meanwhile the outbox keeps delivering to the real receiver
                want.append(valid_id)
                assert outbox.send(data_message(topic, valid_id), timeout_s=5)
            else:
                raw.send(frames, timeout_s=DEADLINE_S)
        wait_counted(topic, before, N_HOSTILE)
        got = []
        while len(got) < len(want) and (msg := holder.recv(timeout_s=5)) is not None:
            got.append(msg.id)
        assert holder.recv(timeout_s=0.3) is None  # no message came twice
        assert outbox.unfinished() == len(held) + len(want)  # nothing released by a forged ack
    finally:
        raw.close()

    assert got == want
    assert delta(rejected(topic), before) == gen.reasons  # each hostile ack counted once, by reason
    assert sum(gen.reasons.values()) == N_HOSTILE and gen.reasons["foreign_ack"] > 0
    holder.done(*held, *want)  # only the real holder releases them
    deadline = time.monotonic() + 5
    while outbox.unfinished():
        assert time.monotonic() < deadline, f"{outbox.unfinished()} messages not released by their holder"
        time.sleep(0.01)


# -- PULL: the supervisor's inbox -----------------------------------------------------------------------


def test_pull_receiver_rejects_fuzz(sockets, endpoint):
    topic, accept = "supervisor", (ComponentReady, ComponentHeartbeat)  # busctl's inbox
    receiver = sockets.bus(topic, "recv", endpoint(topic), bind=True, accept=accept)
    push = sockets.socket(zmq.PUSH)
    push.connect(endpoint(topic))
    gen = HostileMessages(4, accept)
    valid = renamed(realistic_examples()[accept[0].TYPE])
    before = rejected(topic)

    got, want = [], []
    deadline = time.monotonic() + DEADLINE_S

    def drain(timeout_s: float) -> None:
        while (msg := receiver.recv(timeout_s=timeout_s)) is not None:
            got.append(msg.id)
            timeout_s = 0

    for frames, valid_id in stream(gen, valid):
        if valid_id:
            want.append(valid_id)
        while True:  # PUSH blocks at the HWM: drain the receiver meanwhile (one thread, no hang)
            try:
                push.send_multipart(frames, flags=zmq.NOBLOCK)
                break
            except zmq.Again:
                drain(0.005)
                assert time.monotonic() < deadline, "receiver stopped draining"
    while len(got) < len(want) and time.monotonic() < deadline:
        drain(0.1)
    drain(0.2)

    assert got == want  # every valid message arrived, in order, and nothing hostile did
    assert len(want) == N_HOSTILE // VALID_EVERY
    assert delta(rejected(topic), before) == gen.reasons  # each hostile one counted once, by reason
    assert sum(gen.reasons.values()) == N_HOSTILE and "decode" not in gen.reasons


# -- SUB: a subscriber fed by a hostile publisher (e.g. a rogue hub) ----------------------------------


def paced_publish(
    pub: zmq.Socket,
    gen: HostileMessages,
    valid: Callable[[int], Message],
    counted: Callable[[], int],
    on_valid: Callable[[str], None] = lambda _id: None,
) -> int:
    """Publish the stream in chunks, waiting after each until ``counted()`` (the receiver's
    reject count) has caught up, so that no PUB/XPUB HWM ever drops a hostile message."""
    sent = 0
    for frames, valid_id in stream(gen, valid):
        pub.send_multipart(frames, flags=zmq.NOBLOCK)  # never blocks: far below the HWM
        if valid_id:
            on_valid(valid_id)
            continue
        sent += 1
        if sent % CHUNK == 0 or sent == N_HOSTILE:
            deadline = time.monotonic() + DEADLINE_S
            while counted() < sent:
                assert time.monotonic() < deadline, f"receiver counted {counted()} of {sent}"
                time.sleep(0.002)
    return sent


def test_sub_receiver_rejects_fuzz(sockets, endpoint, sync_control):
    pub = sockets.socket(zmq.PUB)  # hostile: raw frames, no validation
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(endpoint("rogue_hub"))
    sub = sockets.bus("control_sub", "recv", endpoint("rogue_hub"), bind=False)
    sync_control(
        lambda n: pub.send_multipart(encode(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="s"))),
        lambda: sub.recv(timeout_s=0.05),
    )
    gen = HostileMessages(11, None)
    before = rejected("control")
    got: list[str] = []
    want: list[str] = []

    def counted() -> int:
        while (msg := sub.recv(timeout_s=0)) is not None:
            got.append(msg.id)
        return sum(delta(rejected("control"), before).values())

    valid = renamed(TrainerStep(id="", step=1, version=1, metrics={"loss": 0.5}))
    assert paced_publish(pub, gen, valid, counted, want.append) == N_HOSTILE
    deadline = time.monotonic() + 5
    while len(got) < len(want) and time.monotonic() < deadline:
        counted()

    assert got == want
    assert delta(rejected("control"), before) == gen.reasons and "decode" not in gen.reasons


# -- XSUB: the hub's receiver; nothing hostile comes out to its subscribers ----------------------------


def test_hub_rejects_fuzz_and_forwards_only_valid(hub, sockets, sync_control):
    pub = sockets.socket(zmq.PUB)  # hostile publisher
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.connect(hub.pub_endpoint)
    raw = sockets.socket(zmq.SUB)  # sees exactly what the hub forwards
    raw.setsockopt(zmq.SUBSCRIBE, b"")
    raw.setsockopt(zmq.RCVHWM, 0)
    raw.connect(hub.sub_endpoint)
    live = sockets.bus("control_sub", "recv", hub.sub_endpoint, bind=False)  # a component's subscriber

    seen = {"raw": False, "live": False}

    def probe_recv():  # both subscribers must be connected before the stream starts
        got = False
        if raw.poll(20):
            raw.recv_multipart()
            seen["raw"] = got = True
        if live.recv(timeout_s=0.02) is not None:
            seen["live"] = got = True
        return True if got and all(seen.values()) else None

    sync_control(
        lambda n: pub.send_multipart(encode(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="s"))), probe_recv
    )
    gen = HostileMessages(12, None)
    before = rejected("control")
    want: list[str] = []
    valid = renamed(RunDone(id="", step=3, reason="marker"))
    counted = lambda: sum(delta(rejected("control"), before).values())
    assert paced_publish(pub, gen, valid, counted, want.append) == N_HOSTILE

    forwarded = []
    while raw.poll(500):
        forwarded.append(decode(raw.recv_multipart(copy=False)).id)  # every forwarded message is valid
    live_got = []
    while (msg := live.recv(timeout_s=0.3)) is not None:
        live_got.append(msg.id)
    forwarded, live_got = ([i for i in ids if not i.startswith("sync-")] for ids in (forwarded, live_got))

    assert forwarded == want and live_got == want
    assert hub.thread.is_alive()
    assert delta(rejected("control"), before) == gen.reasons  # counted once, at the hub; never downstream
    assert "decode" not in gen.reasons
    assert {m.id for m in hub.hub.last.values()} == {want[-1]}  # nothing hostile in the last-value cache


def test_hub_survives_junk_from_subscribers(hub, sockets, sync_control):
    """The hub's XPUB receives whatever a peer XSUB sends (subscriptions or not): junk frames,
    multipart messages and subscription floods leave it forwarding."""
    pub = sockets.bus("control_pub", "send", hub.pub_endpoint, bind=False)
    live = sockets.bus("control_sub", "recv", hub.sub_endpoint, bind=False)
    sync_control(
        lambda n: pub.send(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="s")), lambda: live.recv(timeout_s=0.05)
    )
    rogue = sockets.socket(zmq.XSUB)
    rogue.setsockopt(zmq.SNDHWM, 0)
    rogue.connect(hub.sub_endpoint)
    gen = HostileMessages(13, None)
    for i in range(N_HOSTILE):
        frames = gen.next()
        if i % 10 == 0:
            frames = [b"\x01" + frames[0][:16], *frames[1:]]  # a subscription, maybe with junk after it
        rogue.send_multipart(frames, flags=zmq.NOBLOCK)
    rogue.send(b"\x00")  # and an unsubscribe of everything

    marker = RunDone(id="after-junk", step=1, reason="marker")
    deadline = time.monotonic() + 10
    seen = []
    while "after-junk" not in seen and time.monotonic() < deadline:
        pub.send(marker)
        while (msg := live.recv(timeout_s=0.1)) is not None:
            seen.append(msg.id)
    assert "after-junk" in seen and hub.thread.is_alive()
