"""Blocking topics block at the HWM and lose nothing; PUB never blocks.

``batches`` has HWM 2 on both sides. With ~1.3 MB micro-batches, the two pipes plus the kernel's
socket buffers hold only a handful of messages, so a reader that does not read makes the packer's
``send`` wait and, with a timeout, give up without sending.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import zmq

from bus.messages import RunDone
from bus.topics import TOPICS

BLOCKED = "rlbus_bus_blocked_seconds_total"
SEND_TIMEOUT_S = 0.5
MAX_SENDS = 64  # far above what HWM 2 + kernel buffers can hold at ~1.3 MB each


def test_push_blocks_at_hwm_and_drops_nothing(sockets, endpoint, micro_batch, metric):
    assert TOPICS["batches"].hwm == 2 and TOPICS["batches"].blocks
    packer = sockets.bus("batches", "send", endpoint("batches"), bind=True)
    trainer = sockets.bus("batches", "recv", endpoint("batches"), bind=False)  # connected, not reading
    big = micro_batch(num_tokens=100_000)  # 13 bytes/token: ~1.3 MB of array frames
    blocked_before = metric(BLOCKED, topic="batches")

    sent: list[int] = []
    refused_after_s = None
    for i in range(MAX_SENDS):
        msg = dataclasses.replace(big, id=f"0:{i}", micro_index=i, num_micro_batches=MAX_SENDS)
        started = time.monotonic()
        # The first send also waits for the connection (IMMEDIATE: no queueing towards no peer).
        if not packer.send(msg, timeout_s=5.0 if i == 0 else SEND_TIMEOUT_S):
            refused_after_s = time.monotonic() - started
            break
        sent.append(i)
    assert refused_after_s is not None, f"{MAX_SENDS} sends of ~1.3 MB never blocked at HWM 2"
    assert refused_after_s >= SEND_TIMEOUT_S * 0.9
    assert 2 <= len(sent) < 16
    assert metric(BLOCKED, topic="batches") - blocked_before >= SEND_TIMEOUT_S * 0.9

    received = []
    for _ in sent:
        msg = trainer.recv(timeout_s=2.0)
        assert msg is not None, f"lost messages: got {received}, sent {sent}"
        assert msg.input_ids.shape == big.input_ids.shape
        received.append(msg.micro_index)
    assert received == sent  # every accepted message, in order
    assert trainer.recv(timeout_s=0.2) is None  # and the refused one was never sent

    # Once drained, the packer sends again without waiting.
    assert packer.send(dataclasses.replace(big, id="0:next"), timeout_s=SEND_TIMEOUT_S)
    assert trainer.recv(timeout_s=2.0).id == "0:next"


def test_send_returns_false_when_stopped(sockets, endpoint, example):
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


@pytest.mark.parametrize("topic", ["prompts", "scored", "batches", "supervisor", "rollouts"])
def test_blocking_topics_are_push_pull(topic):
    spec = TOPICS[topic]
    assert spec.blocks and (spec.send_type, spec.recv_type) == (zmq.PUSH, zmq.PULL)
