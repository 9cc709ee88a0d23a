"""The courier: one per process, it owns the ZeroMQ sockets of the data topics, the poller and the
I/O thread that runs the delivery protocol (design: ``docs/DELIVERY.md``).

Components see two objects, both created here: :class:`bus.outbox.Outbox` (sending side:
``send`` keeps a message until the consumer downstream says it is *done* with it, and blocks while
``capacity`` messages are not yet taken) and :class:`bus.inbox.Inbox` (receiving side: ``recv``
returns each message id once, ``done`` releases custody). Those are state machines without
sockets; the courier feeds them the frame sets it receives (parsed by
:func:`bus.envelope.parse_envelope`) and timer ticks, and transmits the
:class:`bus.envelope.Send` lists they return.

Custody passes hop by hop: ``outbox.send(result, upstream=(inbox, input_id))`` calls
``inbox.done(input_id)`` once ``result`` is done downstream, so a message is always held by a
process that can re-send it.

Invariants: only the I/O thread touches the sockets and the boxes' protocol state (other threads
reach it through :meth:`Courier.command`); every send is non-blocking (a frame set that cannot go
out now is handed back to its box with ``unsent``, and nothing more goes to that peer in the same
batch, so per-peer order holds); the side that binds is a ROUTER, the side that connects one DEALER
per endpoint; a ROUTER peer that is unreachable is lost (``unreachable``); a peer silent for
``dead_after_s`` is lost (``silent``). Malformed frames are counted in
``rlbus_bus_rejected_total{topic, reason}`` and dropped.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from bus.envelope import PeerKey, Send, parse_envelope
from bus.inbox import Inbox
from bus.messages import Message
from bus.metrics import BUS_BYTES, BUS_MESSAGES
from bus.outbox import Outbox
from bus.sockets import configure_socket
from bus.topics import TOPICS
from bus.wire import WireError

log = logging.getLogger(__name__)

SOCKET_HWM = 10_000
"""ZeroMQ HWM of the delivery sockets; credit keeps data far below it (envelopes are tiny)."""


@dataclass
class _Link:
    """One ZeroMQ socket of a box: a ROUTER (bound, many peers) or a DEALER (one endpoint)."""

    number: int
    sock: zmq.Socket
    box: Inbox | Outbox
    router: bool


class Courier:
    """Owns a process's data-topic sockets and the I/O thread that runs the delivery protocol.

    Args:
        ctx: the process's ``zmq.Context`` (its CURVE settings secure the sockets).
        heartbeat_s: heartbeat interval towards every peer sent nothing within half of it, seconds.
        dead_after_s: a peer silent this long is declared dead, seconds.
        ack_timeout_s: a message whose receipt is not acknowledged within this is re-sent, seconds.
        stop: blocking calls of the boxes return early once it is set (the I/O thread keeps
            running until :meth:`close`).

    Raises:
        ValueError: non-positive intervals, or ``dead_after_s <= 2 * heartbeat_s``.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        *,
        heartbeat_s: float = 0.5,
        dead_after_s: float = 10.0,
        ack_timeout_s: float = 5.0,
        stop: threading.Event | None = None,
    ) -> None:
        if heartbeat_s <= 0 or ack_timeout_s <= 0 or dead_after_s <= 2 * heartbeat_s:
            raise ValueError("need heartbeat_s > 0, ack_timeout_s > 0 and dead_after_s > 2 * heartbeat_s")
        self.ctx = ctx
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.ack_timeout_s = ack_timeout_s
        self.stop = stop or threading.Event()
        self.session = uuid.uuid4().hex[:16]
        self.boxes: list[Inbox | Outbox] = []
        self._links: list[_Link] = []
        self._commands: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="courier", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------

    def command(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the I/O thread (soon, in order)."""
        self._commands.append((fn, args))
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the thread will wake anyway) or closed

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the I/O thread and return its result (or raise its exception)."""
        done = threading.Event()
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result["value"] = fn(*args)
            except BaseException as exc:  # handed back to the caller's thread
                result["error"] = exc
            done.set()

        self.command(run)
        if not done.wait(30):
            raise RuntimeError("the courier's I/O thread did not answer")
        if "error" in result:
            raise result["error"]
        return result.get("value")

    def receiver(
        self, topic: str, endpoints: str | list[str], *, bind: bool, accept: tuple[type[Message], ...], window: int | None = None
    ) -> Inbox:
        """Open the receiving side of data topic ``topic``.

        Args:
            endpoints: one endpoint to bind, or the endpoints of every sender to connect to.
            accept: message types taken; others are rejected (``unexpected_type``).
            window: credit per sender, messages (default: the topic's HWM).

        Raises:
            ValueError: not a data topic. zmq.ZMQError: an endpoint cannot be bound.
        """
        box = Inbox(topic, accept, window or TOPICS[topic].hwm, session=self.session, post=self.command, stop=self.stop)
        self._call(self._open, box, endpoints, bind, "recv")
        return box

    def sender(self, topic: str, endpoints: str | list[str], *, bind: bool, capacity: int | None = None) -> Outbox:
        """Open the sending side of data topic ``topic`` (see :meth:`receiver`).

        Args:
            capacity: most messages not yet taken by a consumer before ``send`` blocks
                (default: the topic's HWM).
        """
        box = Outbox(topic, capacity or TOPICS[topic].hwm, session=self.session, post=self.command, stop=self.stop)
        self._call(self._open, box, endpoints, bind, "send")
        return box

    def close(self) -> None:
        """Say goodbye to senders (they re-send what this process held), close every socket.

        Idempotent: a second call closes nothing (its wake-up pipe's descriptors may be reused).
        """
        if self._thread.is_alive():
            self._closing = True
            self.command(lambda: None)
            self._thread.join(timeout=10)
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:  # once only: a descriptor number closed twice may belong to someone else by then
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

    # -- I/O thread -------------------------------------------------------------------------------

    def _open(self, box: Inbox | Outbox, endpoints: str | list[str], bind: bool, direction: str) -> None:
        spec = TOPICS[box.topic]
        sock_type = spec.send_type if direction == "send" else spec.recv_type
        eps = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        if (sock_type == zmq.ROUTER) != bind:
            raise ValueError(f"the {direction} side of {box.topic} must {'bind' if sock_type == zmq.ROUTER else 'connect'}")
        groups = [eps] if bind else [[ep] for ep in eps]  # one DEALER per remote endpoint
        for group in groups:
            sock = self.ctx.socket(sock_type)
            configure_socket(sock, self.ctx, hwm=SOCKET_HWM, bind=bind)
            if sock_type == zmq.ROUTER:
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            for ep in group:
                (sock.bind if bind else sock.connect)(ep)
            box.heartbeat_skip_s = self.heartbeat_s / 2  # see bus.peers: heard from within 1.5 periods
            link = _Link(len(self._links), sock, box, router=sock_type == zmq.ROUTER)
            self._links.append(link)
            if not link.router:
                box.dealer_links.append(link.number)
        self.boxes.append(box)

    def transmit(self, box: Inbox | Outbox, sends: list[Send]) -> None:
        """Send what ``box`` returned, without blocking. A frame set that cannot go out now goes back
        to the box (``unsent``), and so does everything after it for the same peer (order holds);
        a ROUTER peer that is gone is lost (``unreachable``)."""
        blocked: set[PeerKey] = set()
        now = time.monotonic() if sends else 0.0
        for send in sends:
            outcome = "later" if send.key in blocked else self._send(send)
            if outcome == "sent":
                peer = box.peers.get(send.key)
                if peer is not None:
                    peer.last_sent = now  # proves this process alive to it: no heartbeat needed soon
                if send.msg_id is not None:
                    BUS_MESSAGES.labels(box.topic, "send").inc()
                    BUS_BYTES.labels(box.topic, "send").inc(send.nbytes)
                continue
            blocked.add(send.key)
            box.unsent(send)
            if outcome == "gone" and send.key in box.peers:
                box.peer_lost(send.key, "unreachable")

    def _send(self, send: Send) -> str:
        """``"sent"``, ``"later"`` (queue full) or ``"gone"`` (a ROUTER peer that left)."""
        link = self._links[send.key[0]]
        parts = [send.key[1], *send.frames] if link.router else send.frames
        try:
            link.sock.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)
            return "sent"
        except zmq.Again:
            return "later"
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:  # ROUTER: that peer is gone
                return "gone"
            raise

    def _receive(self, link: _Link, now: float) -> None:
        for _ in range(256):  # bounded batch per wake, so timers still run under load
            try:
                parts = link.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            routing = b""
            if link.router:
                routing = parts[0].bytes
                parts = parts[1:]
            if not parts:
                link.box.reject("frames", "empty message")
                continue
            try:
                kind, session, payload = parse_envelope(parts[0].bytes)
            except WireError as exc:
                link.box.reject(exc.reason, str(exc))
                continue
            link.box.on_frames((link.number, routing), kind, session, payload, parts[1:], now)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        registered: dict[zmq.Socket, _Link] = {}
        self._next_heartbeat = 0.0
        while True:
            try:
                self._iterate(poller, registered)
            except Exception:  # a bug here must not silently stop delivery: log it and go on
                log.exception("courier I/O loop error")
                time.sleep(0.1)
            if self._closing:
                break
        for box in self.boxes:
            if isinstance(box, Inbox):
                self.transmit(box, box.flush(time.monotonic(), False))
                self.transmit(box, box.goodbye())
        for link in self._links:
            link.sock.close(linger=500)

    def _iterate(self, poller: zmq.Poller, registered: dict[zmq.Socket, _Link]) -> None:
        """One wake of the I/O thread. Its cost per wake grows with the sockets that have input
        and the peers that have acks due, not with every link or peer (links are only added, so
        the new ones are the tail of ``_links``)."""
        for link in self._links[len(registered):]:
            poller.register(link.sock, zmq.POLLIN)
            registered[link.sock] = link
        events = dict(poller.poll(timeout=int(self.heartbeat_s * 500)))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        while self._commands:
            fn, args = self._commands.popleft()
            fn(*args)
        now = time.monotonic()
        for sock in events:
            link = registered.get(sock)
            if link is not None:
                self._receive(link, now)
        heartbeat_due = now >= self._next_heartbeat
        if heartbeat_due:
            self._next_heartbeat = now + self.heartbeat_s
            for box in self.boxes:
                box.expire(now, self.dead_after_s)
                if isinstance(box, Outbox):
                    box.check_deadlines(now, self.ack_timeout_s)
        for box in self.boxes:
            if isinstance(box, Outbox):
                self.transmit(box, box.dispatch(now))
            self.transmit(box, box.flush(now, heartbeat_due))
