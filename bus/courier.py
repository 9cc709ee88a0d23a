"""The courier: one per process, it owns the data topics' sockets (the binder a ROUTER, a connector one
DEALER per endpoint), the poller and the I/O thread that runs the delivery protocol (docs/DELIVERY.md). It
feeds the socket-free state machines :class:`bus.inbox.Inbox` and :class:`bus.outbox.Outbox` the frames it
receives and timer ticks, and transmits the :class:`bus.envelope.Send` lists they return.

Invariants: only the I/O thread touches the sockets and the boxes' protocol state (others go through
:meth:`Courier.command`); every send is non-blocking, and a frame set that cannot go out now goes back to its
box with the rest for that peer, so per-peer order holds. The error paths (all-or-nothing opens, withdrawn
calls, a close that cannot stop the thread, failing after :data:`MAX_LOOP_ERRORS`) are in
docs/ARCHITECTURE.md, "Processes and topics".
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from bus.envelope import PeerKey, Send, parse_envelope
from bus.inbox import Inbox
from bus.messages import Message
from telemetry.metrics import BUS_BYTES, BUS_COURIER_ERRORS, BUS_MESSAGES
from bus.links import Link, open_sockets
from bus.outbox import Outbox
from bus.peers import CourierFailed
from bus.thread_call import call_and_wait
from bus.topics import TOPICS
from bus.wire import WireError
from configs.bus_limits import DEFAULT_MAX_INFLIGHT_BYTES, InflightBytes, check_inflight_bytes, inflight_bytes_for

log = logging.getLogger(__name__)

MAX_LOOP_ERRORS = 10  # I/O-loop exceptions in a row that fail the courier (~1 s of a persistent fault)
LOOP_ERROR_PAUSE_S = 0.1  # pause after an I/O-loop exception, seconds (no busy loop on a fault)


class Courier:
    """Owns a process's data-topic sockets and the I/O thread that runs the delivery protocol.

    Args (seconds for times):
        heartbeat_s: heartbeat period. dead_after_s: a peer silent this long is dead.
        ack_timeout_s: an unacknowledged message is re-sent after it. stop: ends blocking calls early.
        max_inflight_bytes: byte bound of credit and outbox (:mod:`configs.bus_limits`); None: messages only.
        call_timeout_s, close_timeout_s: longest waits for the I/O thread.

    Raises:
        ValueError: non-positive intervals or limits, ``dead_after_s <= 2 * heartbeat_s``, a bad byte bound.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        *,
        heartbeat_s: float = 0.5,
        dead_after_s: float = 10.0,
        ack_timeout_s: float = 5.0,
        stop: threading.Event | None = None,
        max_inflight_bytes: InflightBytes | None = DEFAULT_MAX_INFLIGHT_BYTES,
        call_timeout_s: float = 30.0,
        close_timeout_s: float = 10.0,
        max_loop_errors: int = MAX_LOOP_ERRORS,
    ) -> None:
        if heartbeat_s <= 0 or ack_timeout_s <= 0 or dead_after_s <= 2 * heartbeat_s:
            raise ValueError("need heartbeat_s > 0, ack_timeout_s > 0 and dead_after_s > 2 * heartbeat_s")
        if call_timeout_s <= 0 or close_timeout_s <= 0 or max_loop_errors < 1:
            raise ValueError(
                f"need call_timeout_s > 0, close_timeout_s > 0 and max_loop_errors >= 1, got "
                f"{call_timeout_s}, {close_timeout_s}, {max_loop_errors}"
            )
        if max_inflight_bytes is not None:
            check_inflight_bytes(max_inflight_bytes)
        self.ctx = ctx
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.ack_timeout_s = ack_timeout_s
        self.stop = stop or threading.Event()
        self.max_inflight_bytes = max_inflight_bytes
        self.call_timeout_s = call_timeout_s
        self.close_timeout_s = close_timeout_s
        self.max_loop_errors = max_loop_errors
        self.session = uuid.uuid4().hex[:16]
        self.boxes: list[Inbox | Outbox] = []
        self.failure: BaseException | None = None  # why the I/O thread gave up (set once, by it)
        self._links: list[Link] = []
        self._poller = zmq.Poller()  # I/O thread only
        self._registered: dict[zmq.Socket, Link] = {}  # I/O thread only: sockets in the poller
        self._next_register = 0  # I/O thread only: links from here on are not in the poller yet
        self._next_heartbeat = 0.0
        self._commands: collections.deque[tuple[Callable[..., Any], tuple[Any, ...]]] = collections.deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._pipe_lock = threading.Lock()  # guards the descriptors, _loop_ended and _thread_closes_pipe
        self._loop_ended = False
        self._thread_closes_pipe = False
        self._closing = False
        self._thread = threading.Thread(target=self._run_thread, name="courier", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------

    def command(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the I/O thread (soon, in order)."""
        self._commands.append((fn, args))
        with self._pipe_lock:
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):
                pass  # the pipe is full (the thread will wake anyway) or closed

    def _call(self, fn: Callable[..., Any], *args: Any, undo: Callable[[Any], None] | None = None) -> Any:
        """Run ``fn(*args)`` on the I/O thread and return its result (:func:`bus.thread_call.call_and_wait`).

        Raises:
            TimeoutError: no answer within ``call_timeout_s``.
            bus.peers.CourierFailed: the I/O thread failed (before or while waiting).
            RuntimeError: the courier is closed.
        """
        self._raise_if_unusable()
        try:
            return call_and_wait(
                self.command, fn, *args, timeout_s=self.call_timeout_s, undo=undo, abort=lambda: self._loop_ended
            )
        except TimeoutError:
            self._raise_if_unusable()  # the thread ended meanwhile: say why
            raise

    def _raise_if_unusable(self) -> None:
        if self.failure is not None:
            raise CourierFailed(
                f"the courier's I/O thread failed: {type(self.failure).__name__}: {self.failure}"
            ) from self.failure
        if self._closing or self._loop_ended:
            raise RuntimeError("the courier is closed")

    def receiver(
        self,
        topic: str,
        endpoints: str | list[str],
        *,
        bind: bool,
        accept: tuple[type[Message], ...],
        window: int | None = None,
        window_bytes: int | None = None,
    ) -> Inbox:
        """Open the receiving side of data topic ``topic``: bind one endpoint or connect to every sender's;
        ``accept``: the types taken; ``window`` / ``window_bytes``: credit per sender (default: the topic's
        HWM, the courier's byte bound).

        Raises:
            ValueError: not a data topic, or a bad window. zmq.ZMQError: an endpoint cannot be
            bound or connected (no socket stays open). TimeoutError: see :meth:`_call`.
        """
        window_bytes = window_bytes or self._inflight_bytes(topic)
        box = Inbox(
            topic,
            accept,
            window or TOPICS[topic].hwm,
            window_bytes,
            session=self.session,
            post=self.command,
            stop=self.stop,
        )
        self._call(self._open, box, endpoints, bind, undo=self._discard)
        return box

    def sender(
        self,
        topic: str,
        endpoints: str | list[str],
        *,
        bind: bool,
        capacity: int | None = None,
        capacity_bytes: int | None = None,
    ) -> Outbox:
        """Open the sending side of ``topic`` (as :meth:`receiver`); ``send`` blocks at ``capacity`` messages
        or ``capacity_bytes`` not yet taken."""
        capacity_bytes = capacity_bytes or self._inflight_bytes(topic)
        box = Outbox(
            topic,
            capacity or TOPICS[topic].hwm,
            capacity_bytes,
            session=self.session,
            post=self.command,
            stop=self.stop,
        )
        self._call(self._open, box, endpoints, bind, undo=self._discard)
        return box

    def _inflight_bytes(self, topic: str) -> int | None:
        if topic not in TOPICS or not TOPICS[topic].reliable:
            return None  # the box refuses the topic with the list of data topics
        return inflight_bytes_for(self.max_inflight_bytes, topic)

    def close(self, timeout_s: float | None = None) -> bool:
        """Say goodbye to senders (they re-send what this process held) and close every socket (idempotent).
        Returns False if the I/O thread is still busy after ``timeout_s``: it then closes its sockets and
        wake-up pipe itself when it ends."""
        if self._thread.is_alive():
            self._closing = True
            self.command(lambda: None)
            self._thread.join(self.close_timeout_s if timeout_s is None else timeout_s)
        with self._pipe_lock:
            if not self._loop_ended:
                self._thread_closes_pipe = True
                log.warning(
                    "courier: the I/O thread is still busy after %.1f s; it closes its sockets when it ends",
                    self.close_timeout_s if timeout_s is None else timeout_s,
                )
                return False
            self._close_pipe()
        return True

    def _close_pipe(self) -> None:
        """Close the wake-up pipe once (hold ``_pipe_lock``): a number closed twice may be reused."""
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass

    # -- I/O thread -------------------------------------------------------------------------------

    def _open(self, box: Inbox | Outbox, endpoints: str | list[str], bind: bool) -> list[Link]:
        """Make the sockets of ``box`` (all or none) and serve it; returns the new links."""
        made = open_sockets(self.ctx, box, endpoints, bind)
        box.heartbeat_skip_s = self.heartbeat_s / 2  # see bus.peers: heard from within 1.5 periods
        links = []
        for sock in made:
            link = Link(len(self._links), sock, box, router=sock.type == zmq.ROUTER)
            self._links.append(link)
            links.append(link)
            if not link.router:
                box.dealer_links.append(link.number)
        self.boxes.append(box)
        return links

    def _discard(self, links: list[Link]) -> None:
        """Undo an :meth:`_open` whose caller gave up: close its sockets, forget its box."""
        for link in links:
            link.closed = True
            if self._registered.pop(link.sock, None) is not None:
                self._poller.unregister(link.sock)
            link.sock.close(linger=0)
            if link.box in self.boxes:
                self.boxes.remove(link.box)

    def transmit(self, box: Inbox | Outbox, sends: list[Send]) -> None:
        """Send what ``box`` returned, without blocking; what cannot go now goes back ``unsent`` with the rest
        for that peer (order holds); a ROUTER peer that is gone is lost (``unreachable``)."""
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

    def _receive(self, link: Link, now: float) -> None:
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

    def _run_thread(self) -> None:
        """The I/O thread; closes the wake-up pipe when :meth:`close` gave up waiting."""
        try:
            self._loop()
        finally:
            with self._pipe_lock:
                self._loop_ended = True
                if self._thread_closes_pipe:
                    self._close_pipe()

    def _loop(self) -> None:
        self._next_heartbeat = 0.0
        errors = 0
        while True:
            try:
                self._iterate()
                errors = 0
            except Exception as exc:  # a bug here must not silently stop delivery: count, retry, then fail
                errors += 1
                BUS_COURIER_ERRORS.inc()
                if errors >= self.max_loop_errors:
                    self._fail(exc, errors)
                    break
                log.exception(
                    "courier I/O loop error %d in a row (the courier fails at %d)", errors, self.max_loop_errors
                )
                time.sleep(LOOP_ERROR_PAUSE_S)
            if self._closing:
                break
        self._shutdown()

    def _fail(self, exc: BaseException, errors: int) -> None:
        """Give up: every box's blocking calls raise :class:`bus.peers.CourierFailed` from now on."""
        log.error(
            "courier I/O loop failed %d times in a row; closing the data topics of this process so that it "
            "exits and is restarted",
            errors,
            exc_info=exc,
        )
        self.failure = exc
        for box in self.boxes:
            box.failure = exc

    def _shutdown(self) -> None:
        """Goodbye to every sender (they re-send what this process held), then close every socket."""
        try:
            for box in self.boxes:
                if isinstance(box, Inbox):
                    self.transmit(box, box.flush(time.monotonic(), False))
                    self.transmit(box, box.goodbye())
        except Exception:  # a failed goodbye only makes the senders wait for dead_after_s
            log.exception("courier: goodbye failed; senders notice the silence instead")
        for link in self._links:
            link.sock.close(linger=500)

    def _iterate(self) -> None:
        """One wake; its cost grows with the sockets that have input and the peers with acks due."""
        for link in self._links[self._next_register :]:
            if not link.closed:
                self._poller.register(link.sock, zmq.POLLIN)
                self._registered[link.sock] = link
        self._next_register = len(self._links)
        events = dict(self._poller.poll(timeout=int(self.heartbeat_s * 500)))
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
            link = self._registered.get(sock)
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
