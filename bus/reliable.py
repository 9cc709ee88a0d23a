"""At-least-once delivery with custody on the data topics (design: ``docs/DELIVERY.md``).

A :class:`Courier` (one per process) owns the sockets of the data topics and one I/O thread that
moves every frame. Components see two objects:

- :class:`Outbox` (sending side): :meth:`Outbox.send` keeps the message until the consumer
  downstream says it is *done* with it; it re-sends the message to another live consumer when
  the holder is declared dead (silent for ``dead_after_s``, or gone from a ROUTER), when it says
  goodbye, or when its receipt is not acknowledged within ``ack_timeout_s``. ``send`` blocks
  while ``capacity`` messages are not yet taken by a consumer (backpressure).
- :class:`Inbox` (receiving side): :meth:`Inbox.recv` returns each message id once (duplicates
  are acknowledged and dropped), :meth:`Inbox.done` releases custody. Credit: a receiver grants
  each sender ``window`` messages at a time (messages received but not yet taken by the
  component), so nothing piles up in ZeroMQ queues and the topic's bound stays meaningful.

Custody passes hop by hop: ``outbox.send(result, upstream=(inbox, input_id))`` calls
``inbox.done(input_id)`` once ``result`` is done downstream, so a message is always held by a
process that can re-send it.

Wire (the side that binds is a ROUTER, the side that connects one DEALER per endpoint): every
frame set starts with a msgpack list ``[PROTOCOL, kind, session, payload]``:

| kind | from -> to | payload | frames after |
|---|---|---|---|
| ``D`` | sender -> receiver | message id (str) | the message (:mod:`bus.messages` frames) |
| ``A`` | receiver -> sender | ``[free, taken_ids, done_ids]`` (also its heartbeat) | |
| ``H`` | sender -> receiver | None (heartbeat) | |
| ``B`` | receiver -> sender | None (leaving: re-send what I hold) | |

``session`` is a random id per :class:`Courier`: a peer whose session changes has restarted, so
its predecessor is treated as dead. Malformed frames are counted in
``rlbus_bus_rejected_total{topic, reason}`` and dropped; so is a ``done`` for a message from a
peer it was never sent to (``foreign_ack``: only a holder releases a message).
"""

from __future__ import annotations

import collections
import errno
import heapq
import itertools
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import zmq

from bus.messages import Message, decode, encode
from bus.metrics import (
    BUS_BLOCKED_SECONDS,
    BUS_BYTES,
    BUS_DUPLICATES,
    BUS_MESSAGES,
    BUS_PEER_DEATHS,
    BUS_QUEUED,
    BUS_REDELIVERED,
    BUS_REJECTED,
    declare_topic,
)
from bus.sockets import configure_socket
from bus.topics import TOPICS
from bus.wire import WireError

log = logging.getLogger(__name__)

PROTOCOL = 1
"""Version of the delivery protocol (first element of every envelope)."""

MAX_ENVELOPE_BYTES = 1 << 20
MAX_IDS_PER_ACK = 4096
MAX_ID_CHARS = 256
DONE_MEMORY = 200_000
"""Ids an inbox remembers as done (older ones are forgotten: a re-send that old is re-delivered)."""

SOCKET_HWM = 10_000
"""ZeroMQ HWM of the delivery sockets; credit keeps data far below it (envelopes are tiny)."""

_unpack_limits = dict(
    raw=False,
    max_str_len=MAX_ID_CHARS,
    max_bin_len=0,
    max_array_len=MAX_IDS_PER_ACK,
    max_map_len=0,
    max_ext_len=0,
)

PeerKey = tuple[int, bytes]
"""(link number, ZeroMQ routing id); the routing id is ``b""`` on a DEALER link (one peer)."""


def _envelope(kind: str, session: str, payload: Any) -> bytes:
    return msgpack.packb([PROTOCOL, kind, session, payload])


def _parse_envelope(raw: bytes) -> tuple[str, str, Any]:
    """Returns ``(kind, session, payload)``. Raises WireError on anything malformed."""
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise WireError("too_large", "delivery envelope too large")
    try:
        env = msgpack.unpackb(raw, **_unpack_limits)
    except Exception as exc:
        raise WireError("envelope", f"undecodable delivery envelope: {type(exc).__name__}") from None
    if not (isinstance(env, list) and len(env) == 4 and env[0] == PROTOCOL and env[1] in ("D", "A", "H", "B")):
        raise WireError("envelope", "delivery envelope must be [1, kind, session, payload]")
    _, kind, session, payload = env
    if not isinstance(session, str) or not session:
        raise WireError("envelope", "delivery envelope needs a session string")
    if kind == "D" and not (isinstance(payload, str) and payload):
        raise WireError("envelope", "data envelope needs a message id")
    if kind == "A":
        ok = (
            isinstance(payload, list)
            and len(payload) == 3
            and isinstance(payload[0], int)
            and not isinstance(payload[0], bool)
            and 0 <= payload[0] <= 1_000_000
            and all(isinstance(ids, list) and all(isinstance(i, str) for i in ids) for ids in payload[1:])
        )
        if not ok:
            raise WireError("envelope", "ack envelope must be [free, taken_ids, done_ids]")
    return kind, session, payload


@dataclass
class _Link:
    """One ZeroMQ socket of a box: a ROUTER (bound, many peers) or a DEALER (one endpoint)."""

    number: int
    sock: zmq.Socket
    box: "Outbox | Inbox"
    router: bool


@dataclass
class _Peer:
    session: str
    last_seen: float
    free: int = 0  # sender side: credit the receiver last reported
    untaken: set[str] = field(default_factory=set)  # sender side: sent, receipt not yet acknowledged
    holding: set[str] = field(default_factory=set)  # sender side: sent and not done
    queued: int = 0  # receiver side: its messages waiting in the inbox
    acks_taken: list[str] = field(default_factory=list)  # receiver side: to acknowledge
    acks_done: list[str] = field(default_factory=list)
    dirty: bool = False  # receiver side: credit changed, tell the sender


@dataclass
class _Entry:
    msg_id: str
    seq: int
    frames: list[Any]
    nbytes: int
    upstreams: list[tuple["Inbox", str]]
    peer: PeerKey | None = None
    sent_at: float = 0.0
    taken: bool = False
    sent_to: set[PeerKey] = field(default_factory=set)  # every peer it went to: only they may release it


class _Box:
    """What an inbox and an outbox share: topic, links, peers, the owning courier."""

    role = ""

    def __init__(self, courier: "Courier", topic: str) -> None:
        if topic not in TOPICS or not TOPICS[topic].reliable:
            raise ValueError(f"{topic!r} is not a data topic; data topics: {sorted(t for t, s in TOPICS.items() if s.reliable)}")
        self.courier = courier
        self.topic = topic
        self.links: list[_Link] = []
        self.peers: dict[PeerKey, _Peer] = {}
        self._rejected_reasons: set[str] = set()
        declare_topic(topic, "recv" if self.role == "inbox" else "send", reliable=True)

    def reject(self, reason: str, detail: str) -> None:
        """Count a dropped frame set and log the first one of each reason."""
        BUS_REJECTED.labels(self.topic, reason).inc()
        if reason not in self._rejected_reasons:
            self._rejected_reasons.add(reason)
            log.warning("rejected a message on %s (%s); further ones are only counted", self.topic, detail)

    def peer_for(self, key: PeerKey, session: str, now: float) -> _Peer:
        """The peer of ``key``; a new session on a known key means the old peer restarted."""
        peer = self.peers.get(key)
        if peer is not None and peer.session != session:
            self.peer_lost(key, "restarted")
            peer = None
        if peer is None:
            peer = self.peers[key] = _Peer(session=session, last_seen=now)
            self.peer_joined(key, peer)
        peer.last_seen = now
        return peer

    def peer_joined(self, key: PeerKey, peer: _Peer) -> None:
        """Hook: a new peer spoke first."""

    def peer_lost(self, key: PeerKey, reason: str) -> None:
        """Forget a peer (dead, restarted or gone); subclasses re-send what it held."""
        if self.peers.pop(key, None) is not None:
            BUS_PEER_DEATHS.labels(self.topic, reason).inc()
            log.info("%s: peer %s of %s lost (%s)", self.role, key, self.topic, reason)


class Inbox(_Box):
    """Receiving side of a data topic. Create with :meth:`Courier.receiver`.

    Thread-safety: :meth:`recv` and :meth:`done` may be called from any thread.
    """

    role = "inbox"

    def __init__(self, courier: "Courier", topic: str, accept: tuple[type[Message], ...], window: int) -> None:
        super().__init__(courier, topic)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.accept = accept
        self.window = window
        self._queue: queue.Queue[tuple[PeerKey, _Peer, Message]] = queue.Queue()
        self.held: dict[str, set[PeerKey]] = {}  # I/O thread: ids taken and not done -> who sent them
        self.done_ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    # -- component side ---------------------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next new message; None on timeout (``0``: do not wait) or once the courier stops.

        Duplicates (an id already received and not forgotten) never come out of here.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            try:
                key, peer, msg = self._queue.get(timeout=max(remaining, 0)) if remaining > 0 else self._queue.get_nowait()
            except queue.Empty:
                if self.courier.stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    return None
                continue
            self.courier.command(self._consumed, key, peer)
            return msg

    def done(self, *ids: str) -> None:
        """Release custody of ``ids``: their senders may forget them. Unknown ids are ignored."""
        if ids:
            self.courier.command(self.release, ids)

    # -- I/O thread -------------------------------------------------------------------------------

    def _consumed(self, key: PeerKey, peer: _Peer) -> None:
        # only the peer that sent it gets the credit back: not a successor under the same key
        # (a restarted sender), whose credit would otherwise grow past the window for good
        if self.peers.get(key) is peer:
            peer.queued -= 1
            peer.dirty = True

    def release(self, ids: tuple[str, ...] | list[str]) -> None:
        """Mark ``ids`` done and tell whoever sent them (I/O thread)."""
        for msg_id in ids:
            senders = self.held.pop(msg_id, None)
            if senders is None:
                continue
            self._remember_done(msg_id)
            for key in senders:
                peer = self.peers.get(key)
                if peer is not None:
                    peer.acks_done.append(msg_id)

    def _remember_done(self, msg_id: str) -> None:
        self.done_ids[msg_id] = None
        if len(self.done_ids) > DONE_MEMORY:
            self.done_ids.popitem(last=False)

    def on_frames(self, key: PeerKey, kind: str, session: str, payload: Any, rest: list[zmq.Frame], now: float) -> None:
        if kind == "A" or kind == "B":
            self.reject("wrong_direction", f"{kind} envelope sent to a receiver")
            return
        peer = self.peer_for(key, session, now)
        if kind == "H":
            return
        msg_id: str = payload
        BUS_MESSAGES.labels(self.topic, "recv").inc()
        BUS_BYTES.labels(self.topic, "recv").inc(sum(len(f) for f in rest))
        if msg_id in self.done_ids:
            BUS_DUPLICATES.labels(self.topic).inc()
            peer.acks_taken.append(msg_id)
            peer.acks_done.append(msg_id)
            return
        if msg_id in self.held:
            BUS_DUPLICATES.labels(self.topic).inc()
            self.held[msg_id].add(key)
            peer.acks_taken.append(msg_id)
            return
        try:
            msg = decode(rest)
        except WireError as exc:
            self.reject(exc.reason, str(exc))
            return
        except Exception as exc:  # any decoder bug on hostile input is still just a reject
            self.reject("decode", f"{type(exc).__name__}: {exc}")
            return
        if type(msg) not in self.accept:
            self.reject("unexpected_type", f"{msg.TYPE} is not accepted on {self.topic}")
            return
        if msg.id != msg_id:
            self.reject("id_mismatch", "envelope id differs from the message id")
            return
        self.held[msg_id] = {key}
        peer.queued += 1
        peer.acks_taken.append(msg_id)
        self._queue.put((key, peer, msg))

    def flush(self, now: float, heartbeat_due: bool) -> None:
        """Send pending acknowledgements and credit (and heartbeats when due)."""
        for key, peer in list(self.peers.items()):
            beat = heartbeat_due  # every peer gets its heartbeat (not only the first one)
            while peer.acks_taken or peer.acks_done or peer.dirty or beat:
                taken, done = peer.acks_taken[:MAX_IDS_PER_ACK], peer.acks_done[:MAX_IDS_PER_ACK]
                del peer.acks_taken[: len(taken)], peer.acks_done[: len(done)]
                free = max(self.window - peer.queued, 0)
                if not self.courier.transmit(self, key, [_envelope("A", self.courier.session, [free, taken, done])]):
                    # could not go out now: keep the releases (and the credit update) for the next
                    # flush; a lost receipt ack only makes the sender re-send, which is acked again
                    peer.acks_done[:0] = done
                    break
                peer.dirty = beat = False
        for link in self.links:
            if not link.router and (link.number, b"") not in self.peers and heartbeat_due:
                # say hello on an endpoint whose sender we have not heard yet (credit starts there)
                self.courier.transmit(self, (link.number, b""), [_envelope("A", self.courier.session, [self.window, [], []])])
        BUS_QUEUED.labels(self.topic, "inbox").set(self._queue.qsize())

    def goodbye(self) -> None:
        for key in list(self.peers):
            self.courier.transmit(self, key, [_envelope("B", self.courier.session, None)])

    def peer_joined(self, key: PeerKey, peer: _Peer) -> None:
        peer.dirty = True  # grant it credit at once

    def peer_lost(self, key: PeerKey, reason: str) -> None:
        super().peer_lost(key, reason)
        for senders in self.held.values():
            senders.discard(key)


class Outbox(_Box):
    """Sending side of a data topic. Create with :meth:`Courier.sender`.

    Thread-safety: :meth:`send` may be called from any thread (one message at a time per caller).
    """

    role = "outbox"

    def __init__(self, courier: "Courier", topic: str, capacity: int) -> None:
        super().__init__(courier, topic)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.entries: dict[str, _Entry] = {}  # I/O thread
        self._pending: list[tuple[int, str]] = []  # heap of (seq, id): not with any peer
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._not_taken = 0  # guarded by _cond: queued by send() or in flight, not yet taken
        self._unfinished = 0  # guarded by _cond: sent and not done

    # -- component side ---------------------------------------------------------------------------

    def send(self, msg: Message, *, upstream: tuple[Inbox, str] | None = None, timeout_s: float | None = None) -> bool:
        """Keep ``msg`` until it is done downstream; block while the outbox is full (the wait is
        counted in ``rlbus_bus_blocked_seconds_total{topic}``).

        Args:
            msg: a data message (its ``id`` identifies it end to end).
            upstream: ``(inbox, id)``: call ``inbox.done(id)`` once ``msg`` is done downstream.
            timeout_s: give up after this many seconds (None: until sent or stopped).

        Returns:
            True once the courier holds the message; False on timeout or stop (not sent).

        Raises:
            TypeError: ``msg`` is not a registered message type (see :func:`bus.messages.encode`).
            ValueError: ``msg.id`` is empty or longer than :data:`MAX_ID_CHARS` (no receiver would take it).
        """
        if not msg.id or len(msg.id) > MAX_ID_CHARS:
            raise ValueError(f"{msg.TYPE} id must be 1..{MAX_ID_CHARS} characters, got {len(msg.id)}")
        frames = encode(msg)
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        stop = self.courier.stop
        with self._cond:
            while self._not_taken >= self.capacity:
                if stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    BUS_BLOCKED_SECONDS.labels(self.topic).inc(time.monotonic() - started)
                    return False
                self._cond.wait(0.1)
            self._not_taken += 1
            self._unfinished += 1
        if (waited := time.monotonic() - started) > 0.01:  # backpressure: counted like BusSocket's waits
            BUS_BLOCKED_SECONDS.labels(self.topic).inc(waited)
        nbytes = sum(f.nbytes if hasattr(f, "nbytes") else len(f) for f in frames)
        self.courier.command(self._add, msg.id, frames, nbytes, upstream)
        return True

    def unfinished(self) -> int:
        """Messages sent and not yet done downstream."""
        with self._cond:
            return self._unfinished

    # -- I/O thread -------------------------------------------------------------------------------

    def _count(self, not_taken: int = 0, unfinished: int = 0) -> None:
        with self._cond:
            self._not_taken += not_taken
            self._unfinished += unfinished
            self._cond.notify_all()

    def _add(self, msg_id: str, frames: list[Any], nbytes: int, upstream: tuple[Inbox, str] | None) -> None:
        upstreams = [upstream] if upstream is not None else []
        if msg_id in self.entries:  # the same message again: one copy travels, both inputs are released with it
            self._count(not_taken=-1, unfinished=-1)
            self.entries[msg_id].upstreams.extend(upstreams)
            return
        entry = _Entry(msg_id, next(self._seq), frames, nbytes, upstreams)
        self.entries[msg_id] = entry
        heapq.heappush(self._pending, (entry.seq, msg_id))

    def _requeue(self, entry: _Entry, reason: str) -> None:
        peer = self.peers.get(entry.peer) if entry.peer is not None else None
        if peer is not None:
            peer.untaken.discard(entry.msg_id)
            peer.holding.discard(entry.msg_id)
        if entry.taken:
            self._count(not_taken=1)
        entry.peer, entry.taken = None, False
        heapq.heappush(self._pending, (entry.seq, entry.msg_id))
        BUS_REDELIVERED.labels(self.topic, reason).inc()

    def peer_lost(self, key: PeerKey, reason: str) -> None:
        peer = self.peers.get(key)
        super().peer_lost(key, reason)
        if peer is None:
            return
        for msg_id in sorted(peer.holding, key=lambda i: self.entries[i].seq if i in self.entries else -1):
            entry = self.entries.get(msg_id)
            if entry is not None and entry.peer == key:
                self._requeue(entry, reason)

    def on_frames(self, key: PeerKey, kind: str, session: str, payload: Any, rest: list[zmq.Frame], now: float) -> None:
        if kind == "D" or kind == "H":
            self.reject("wrong_direction", f"{kind} envelope sent to a sender")
            return
        if kind == "B":
            if key in self.peers:
                self.peer_lost(key, "goodbye")
            return
        peer = self.peer_for(key, session, now)
        free, taken, done = payload
        peer.free = free
        for msg_id in taken:
            entry = self.entries.get(msg_id)
            if entry is not None and entry.peer == key and not entry.taken:
                entry.taken = True
                peer.untaken.discard(msg_id)
                self._count(not_taken=-1)
        foreign = False
        for msg_id in done:
            entry = self.entries.get(msg_id)
            if entry is not None and key not in entry.sent_to:
                foreign = True  # a peer that never got it cannot release it (forged or misrouted ack)
                continue
            self._finish(msg_id)
        if foreign:
            self.reject("foreign_ack", "done for a message this peer was never sent")

    def _finish(self, msg_id: str) -> None:
        entry = self.entries.pop(msg_id, None)
        if entry is None:
            return
        if entry.peer is not None and entry.peer in self.peers:
            peer = self.peers[entry.peer]
            peer.untaken.discard(msg_id)
            peer.holding.discard(msg_id)
        self._count(not_taken=0 if entry.taken else -1, unfinished=-1)
        for inbox, upstream_id in entry.upstreams:
            inbox.release([upstream_id])

    def dispatch(self, now: float) -> None:
        """Send pending messages to live peers with credit, oldest first."""
        while self._pending:
            seq, msg_id = self._pending[0]
            entry = self.entries.get(msg_id)
            if entry is None or entry.seq != seq or entry.peer is not None:
                heapq.heappop(self._pending)  # done, or already re-dispatched
                continue
            key = self._pick_peer()
            if key is None:
                return
            envelope = _envelope("D", self.courier.session, msg_id)
            if not self.courier.transmit(self, key, [envelope, *entry.frames]):
                return
            heapq.heappop(self._pending)
            peer = self.peers[key]
            entry.peer, entry.sent_at = key, now
            entry.sent_to.add(key)
            peer.untaken.add(msg_id)
            peer.holding.add(msg_id)
            BUS_MESSAGES.labels(self.topic, "send").inc()
            BUS_BYTES.labels(self.topic, "send").inc(entry.nbytes)

    def _pick_peer(self) -> PeerKey | None:
        best, best_free = None, 0
        for key, peer in self.peers.items():
            free = peer.free - len(peer.untaken)
            if free > best_free:
                best, best_free = key, free
        if best is not None:  # rotate so that equal peers share the work
            self.peers[best] = self.peers.pop(best)
        return best

    def check_deadlines(self, now: float, ack_timeout_s: float) -> None:
        """Re-send messages whose receipt was not acknowledged in time."""
        for peer in list(self.peers.values()):
            late = [i for i in peer.untaken if now - self.entries[i].sent_at > ack_timeout_s] if peer.untaken else []
            for msg_id in sorted(late, key=lambda i: self.entries[i].seq):
                self._requeue(self.entries[msg_id], "ack_timeout")

    def flush(self, now: float, heartbeat_due: bool) -> None:
        if heartbeat_due:
            hb = _envelope("H", self.courier.session, None)
            for key in list(self.peers):
                self.courier.transmit(self, key, [hb])
            for link in self.links:
                if not link.router and (link.number, b"") not in self.peers:
                    self.courier.transmit(self, (link.number, b""), [hb])
        with self._cond:
            BUS_QUEUED.labels(self.topic, "outbox_not_taken").set(self._not_taken)
            BUS_QUEUED.labels(self.topic, "outbox_unfinished").set(self._unfinished)


class Courier:
    """Owns a process's data-topic sockets and the I/O thread that runs the delivery protocol.

    Args:
        ctx: the process's ``zmq.Context`` (its CURVE settings secure the sockets).
        heartbeat_s: heartbeat interval towards every peer, seconds.
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
        box = Inbox(self, topic, accept, window or TOPICS[topic].hwm)
        self._call(self._open, box, endpoints, bind, "recv")
        return box

    def sender(self, topic: str, endpoints: str | list[str], *, bind: bool, capacity: int | None = None) -> Outbox:
        """Open the sending side of data topic ``topic`` (see :meth:`receiver`).

        Args:
            capacity: most messages not yet taken by a consumer before ``send`` blocks
                (default: the topic's HWM).
        """
        box = Outbox(self, topic, capacity or TOPICS[topic].hwm)
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
            link = _Link(len(self._links), sock, box, router=sock_type == zmq.ROUTER)
            self._links.append(link)
            box.links.append(link)
        self.boxes.append(box)

    def transmit(self, box: _Box, key: PeerKey, frames: list[Any]) -> bool:
        """Send ``frames`` to peer ``key`` without blocking; False if it could not go out now."""
        link = self._links[key[0]]
        parts = [key[1], *frames] if link.router else frames
        try:
            link.sock.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == errno.EHOSTUNREACH:  # ROUTER: that peer is gone
                if key in box.peers:
                    box.peer_lost(key, "unreachable")
                return False
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
                kind, session, payload = _parse_envelope(parts[0].bytes)
            except WireError as exc:
                link.box.reject(exc.reason, str(exc))
                continue
            link.box.on_frames((link.number, routing), kind, session, payload, parts[1:], now)

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        registered: set[int] = set()
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
                box.flush(time.monotonic(), False)
                box.goodbye()
        for link in self._links:
            link.sock.close(linger=500)

    def _iterate(self, poller: zmq.Poller, registered: set[int]) -> None:
        for link in self._links:
            if link.number not in registered:
                poller.register(link.sock, zmq.POLLIN)
                registered.add(link.number)
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
        for link in self._links:
            if events.get(link.sock):
                self._receive(link, now)
        heartbeat_due = now >= self._next_heartbeat
        if heartbeat_due:
            self._next_heartbeat = now + self.heartbeat_s
            for box in self.boxes:
                for key, peer in list(box.peers.items()):
                    if now - peer.last_seen > self.dead_after_s:
                        box.peer_lost(key, "silent")
                if isinstance(box, Outbox):
                    box.check_deadlines(now, self.ack_timeout_s)
        for box in self.boxes:
            if isinstance(box, Outbox):
                box.dispatch(now)
            box.flush(now, heartbeat_due)
