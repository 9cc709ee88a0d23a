"""The one socket factory of rlbus (:func:`configure_socket`) and :class:`BusSocket`, the typed socket of the
non-data topics (control, supervisor): the topic's HWM, bounded linger, ``IMMEDIATE`` on senders, CURVE when
the context has it; messages and bytes counted per topic and direction; malformed input a counted,
logged-once reject, never an exception. A blocking topic's ``send`` waits at the HWM (counted in
``rlbus_bus_blocked_seconds_total``); PUB never blocks and drops at the HWM.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq

from bus import auth
from bus.codec import decode, encode
from bus.messages import Message
from telemetry.metrics import BUS_BLOCKED_SECONDS, BUS_BYTES, BUS_MESSAGES, BUS_REJECTED, declare_topic
from bus.topics import TOPICS
from bus.wire import WireError

log = logging.getLogger(__name__)

LINGER_MS = 500  # close() flushes unsent messages at most this long
POLL_SLICE_S = 0.1  # blocking sends and receives check for a stop request this often, seconds


def frame_bytes(frames: list[Any]) -> int:
    """Bytes of a frame list on the wire (what credit windows and byte counters count)."""
    return sum(f.nbytes if hasattr(f, "nbytes") else len(f) for f in frames)


def configure_socket(sock: zmq.Socket, ctx: zmq.Context, *, hwm: int, bind: bool) -> None:
    """HWM both ways, bounded linger, ``IMMEDIATE`` on PUSH and DEALER, CURVE when the context has it."""
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if sock.type in (zmq.PUSH, zmq.DEALER):
        sock.setsockopt(zmq.IMMEDIATE, 1)
    curve = auth.for_context(ctx)
    if curve is not None:
        curve.secure(sock, server=bind)


class BusSocket:
    """A ZeroMQ socket of one topic (:data:`bus.topics.TOPICS`) and direction (``send``/``recv``), speaking
    :mod:`bus.messages`; ``stop`` ends blocking calls early; ``accept`` (None: all) the types taken.

    Raises:
        ValueError: unknown topic or direction.
        zmq.ZMQError: the endpoint cannot be bound or connected.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        topic: str,
        direction: str,
        endpoint: str | list[str],
        *,
        bind: bool,
        stop: threading.Event | None = None,
        accept: tuple[type[Message], ...] | None = None,
    ) -> None:
        spec = TOPICS.get(topic)
        if spec is None:
            raise ValueError(f"unknown topic {topic!r}; known: {sorted(TOPICS)}")
        if spec.reliable:
            raise ValueError(f"{topic!r} is a data topic with at-least-once delivery: use bus.courier.Courier")
        if direction not in ("send", "recv"):
            raise ValueError(f"direction must be 'send' or 'recv', got {direction!r}")
        self.topic = "control" if spec.name.startswith("control") else spec.name
        self.direction = direction
        self.blocks = spec.blocks
        self._stop = stop or threading.Event()
        self.accept = accept
        self._rejected_reasons: set[str] = set()
        declare_topic(self.topic, direction, reliable=False)
        self.sock = ctx.socket(spec.send_type if direction == "send" else spec.recv_type)
        configure_socket(self.sock, ctx, hwm=spec.hwm, bind=bind)
        if self.sock.type == zmq.SUB:
            self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        for ep in [endpoint] if isinstance(endpoint, str) else endpoint:
            (self.sock.bind if bind else self.sock.connect)(ep)

    # -- sending ---------------------------------------------------------------------------------

    def send(self, msg: Message, timeout_s: float | None = None) -> bool:
        """Send ``msg``, on a blocking topic waiting at the HWM; False on timeout (seconds) or stop."""
        frames = encode(msg)
        if not self.blocks:
            try:
                self.sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:
                return False  # PUB/XPUB at HWM: dropped, by design
            self._count_sent(frames)
            return True
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        while not self.sock.poll(int(POLL_SLICE_S * 1000), zmq.POLLOUT):
            if self._stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                BUS_BLOCKED_SECONDS.labels(self.topic).inc(time.monotonic() - started)
                return False
        waited = time.monotonic() - started
        if waited > POLL_SLICE_S / 10:
            BUS_BLOCKED_SECONDS.labels(self.topic).inc(waited)
        self.sock.send_multipart(frames, copy=False)
        self._count_sent(frames)
        return True

    def _count_sent(self, frames: list[Any]) -> None:
        BUS_MESSAGES.labels(self.topic, "send").inc()
        BUS_BYTES.labels(self.topic, "send").inc(frame_bytes(frames))

    # -- receiving -------------------------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next valid message (malformed ones counted and skipped); None on timeout (0: no wait) or stop."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = POLL_SLICE_S if deadline is None else min(POLL_SLICE_S, deadline - time.monotonic())
            if self.sock.poll(max(0, int(remaining * 1000)), zmq.POLLIN):
                msg = self.recv_ready()
                if msg is not None:
                    return msg
                continue
            if self._stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return None

    def recv_ready(self) -> Message | None:
        """Receive one message that a poller reported ready; None if it was malformed."""
        frames = self.sock.recv_multipart(copy=False)
        BUS_MESSAGES.labels(self.topic, "recv").inc()
        BUS_BYTES.labels(self.topic, "recv").inc(sum(len(f) for f in frames))
        try:
            msg = decode(frames)
        except WireError as exc:
            self.reject(exc.reason, str(exc))
            return None
        except Exception as exc:  # any decoder bug on hostile input is still just a reject
            self.reject("decode", f"{type(exc).__name__}: {exc}")
            return None
        if self.accept is not None and type(msg) not in self.accept:
            self.reject("unexpected_type", f"{msg.TYPE} is not accepted on {self.topic}")
            return None
        return msg

    def reject(self, reason: str, detail: str) -> None:
        """Count a dropped message and log the first one of each reason."""
        BUS_REJECTED.labels(self.topic, reason).inc()
        if reason not in self._rejected_reasons:
            self._rejected_reasons.add(reason)
            log.warning("rejected a message on %s (%s); further ones are only counted", self.topic, detail)

    def close(self) -> None:
        """Close the socket with the bounded linger."""
        self.sock.close(linger=LINGER_MS)
