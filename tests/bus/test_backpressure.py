"""Backpressure: data topics are bounded by credit and lose nothing; PUB never blocks.

On a data topic (:mod:`bus.courier`) a receiver grants each sender ``window`` messages it has
not yet taken, and a sender's outbox holds ``capacity`` more before ``send`` blocks; both are the
topic's bound (``batches``: 2 and 2). So a trainer that does not read stops the packer's
``send`` after exactly ``window + capacity`` micro-batches, whatever their size, and a stalled
stage stops its upstream hop by hop. The wait is counted in ``rlbus_bus_blocked_seconds_total``.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import zmq

from bus.messages import Prompt, RunDone, ScoredGroup
from bus.topics import TOPICS
from reliable_peer import data_message

BLOCKED = "rlbus_bus_blocked_seconds_total"
SEND_TIMEOUT_S = 0.5
MAX_SENDS = 64


def test_credit_blocks_the_sender_and_drops_nothing(couriers, endpoint, micro_batch, metric):
    spec = TOPICS["batches"]
    assert spec.reliable and spec.hwm == 2
    packer = couriers().sender("batches", endpoint("batches"), bind=True)
    trainer = couriers().receiver(
        "batches", endpoint("batches"), bind=False, accept=(type(micro_batch()),)
    )  # not reading
    big = micro_batch(num_tokens=100_000)  # 13 bytes/token: ~1.3 MB of array frames
    blocked_before = metric(BLOCKED, topic="batches")

    sent: list[int] = []
    refused_after_s = None
    for i in range(MAX_SENDS):
        msg = dataclasses.replace(big, id=f"0:{i}", micro_index=i, num_micro_batches=MAX_SENDS)
        started = time.monotonic()
        # Beyond the outbox's capacity a send waits for the trainer to take messages (after connecting).
        patient = packer.capacity <= i < packer.capacity + trainer.window
        if not packer.send(msg, timeout_s=5.0 if patient else SEND_TIMEOUT_S):
            refused_after_s = time.monotonic() - started
            break
        sent.append(i)
    assert refused_after_s is not None, f"{MAX_SENDS} sends never blocked"
    assert len(sent) == trainer.window + packer.capacity == 2 * spec.hwm
    assert refused_after_s >= SEND_TIMEOUT_S * 0.9  # it waited out its timeout
    assert metric(BLOCKED, topic="batches") - blocked_before >= SEND_TIMEOUT_S * 0.9

    received = []
    for _ in sent:
        msg = trainer.recv(timeout_s=2.0)
        assert msg is not None, f"lost messages: got {received}, sent {sent}"
        assert msg.input_ids.shape == big.input_ids.shape
        received.append(msg.micro_index)
        trainer.done(msg.id)
    assert received == sent  # every accepted message, in order
    assert trainer.recv(timeout_s=0.2) is None  # and the refused one was never sent

    # Once drained, the packer sends again without waiting.
    assert packer.send(dataclasses.replace(big, id="0:next"), timeout_s=SEND_TIMEOUT_S)
    assert trainer.recv(timeout_s=2.0).id == "0:next"


def test_backpressure_propagates_upstream_hop_by_hop(couriers, endpoint):
    """A -> B -> C where C never reads: B's forwarding loop blocks, so A's sends stop too, after
    exactly what the two hops hold (credit and outbox of each, plus the message in B's hand)."""
    a, b, c = couriers(), couriers(), couriers()
    a_out = a.sender("prompts", endpoint("prompts"), bind=True)
    b_in = b.receiver("prompts", endpoint("prompts"), bind=False, accept=(Prompt,))
    _c_in = c.receiver("scored", endpoint("scored"), bind=True, accept=(ScoredGroup,))  # never reads
    b_out = b.sender("scored", endpoint("scored"), bind=False)
    stop = threading.Event()
    forwarded: list[str] = []

    def forward() -> None:  # a reward worker's loop: one input, one output, custody passed on
        while not stop.is_set():
            msg = b_in.recv(timeout_s=0.05)
            if msg is not None:
                while not b_out.send(data_message("scored", msg.id), upstream=(b_in, msg.id), timeout_s=0.05):
                    if stop.is_set():
                        return
                forwarded.append(msg.id)

    worker = threading.Thread(target=forward, daemon=True)
    worker.start()
    try:
        handed = 0
        while a_out.send(data_message("prompts", f"p-{handed}"), timeout_s=1.5):
            handed += 1
            assert handed < 200, "the source was never stopped"
        bound = (_c_in.window + b_out.capacity) + 1 + (b_in.window + a_out.capacity)
        print(
            f"A handed over {handed} = C's credit + B's outbox ({_c_in.window} + {b_out.capacity}) + 1 in B's hand "
            f"+ B's credit + A's outbox ({b_in.window} + {a_out.capacity})"
        )
        assert handed == bound
        assert len(forwarded) == _c_in.window + b_out.capacity
        assert a_out.unfinished() == handed  # nothing was released: C holds custody of what it got
    finally:
        stop.set()
        worker.join(timeout=5)


def test_send_returns_false_when_stopped(couriers, sockets, endpoint, example):
    courier = couriers()
    outbox = courier.sender("batches", endpoint("batches"), bind=True)  # no receiver ever connects
    for i in range(outbox.capacity):
        assert outbox.send(dataclasses.replace(example("micro_batch"), id=f"b-{i}"), timeout_s=1.0)
    inbox = courier.receiver("scored", endpoint("scored"), bind=True, accept=(ScoredGroup,))
    courier.stop.set()
    # the full outbox waits, the empty inbox waits: the stop event ends both within one slice
    started = time.monotonic()
    assert outbox.send(example("micro_batch"), timeout_s=10.0) is False
    assert inbox.recv(timeout_s=10.0) is None
    assert time.monotonic() - started < 1.0

    stop = threading.Event()
    stop.set()
    # No peer ever connects: with IMMEDIATE the message cannot be queued, so send waits; the
    # set stop event ends the wait within one poll slice instead of the 10 s timeout.
    lonely = sockets.bus("supervisor", "send", endpoint("nobody-home"), bind=False, stop=stop)
    started = time.monotonic()
    assert lonely.send(example("component.ready"), timeout_s=10.0) is False
    assert time.monotonic() - started < 1.0


def test_pub_never_blocks(sockets, endpoint, metric):
    spec = TOPICS["control_pub"]
    assert not spec.blocks
    sub = sockets.socket(zmq.SUB)  # subscribed and connected, but never reads
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 100)
    sub.bind(endpoint("control"))
    pub = sockets.bus("control_pub", "send", endpoint("control"), bind=False)
    deadline = time.monotonic() + 2.0
    while not pub.send(RunDone(id="probe", step=0, reason="probe")) or not sub.poll(10, zmq.POLLIN):
        assert time.monotonic() < deadline, "subscriber never connected"
    blocked_before = metric(BLOCKED, topic="control")

    # Past SNDHWM (10k) PUB drops instead of waiting: every send returns at once (a blocking send
    # would sit out its 5 s timeout).
    num_sends = spec.hwm + 500
    padding = "x" * 200
    slowest = 0.0
    for i in range(num_sends):
        t0 = time.monotonic()
        pub.send(RunDone(id=str(i), step=i, reason=padding), timeout_s=5.0)
        slowest = max(slowest, time.monotonic() - t0)
    assert slowest < 1.0, slowest
    assert metric(BLOCKED, topic="control") == blocked_before

    received = 0
    while sub.poll(200, zmq.POLLIN):
        sub.recv_multipart(copy=False)
        received += 1
    assert received < num_sends  # some were dropped at the HWM: proof that the queue was full
