"""Sending side of a data topic: capacity, dispatch to peers with credit, ack deadlines, re-sends
(protocol: ``docs/DELIVERY.md``, envelope: :mod:`bus.envelope`, peers: :mod:`bus.peers`).

:class:`Outbox` is a state machine: its courier (or a test) feeds it the frame sets received
(:meth:`Outbox.on_frames`) and timer ticks (:meth:`Outbox.check_deadlines`,
:meth:`Outbox.dispatch`, :meth:`Outbox.flush`, each with ``now``), and transmits the
:class:`bus.envelope.Send` list they return, handing back with :meth:`Outbox.unsent` what could
not go out. The component side (:meth:`Outbox.send`, :meth:`Outbox.unfinished`) may be called from
any thread; it reaches the state through ``post``.

Invariants:
- a message is kept until a peer it was sent to says it is done (only those peers may release it:
  a ``done`` from any other is a ``foreign_ack`` reject);
- a message is with at most one peer at a time; it goes back to the pending queue (oldest first by
  send order) when that peer is lost or its receipt is not acknowledged within ``ack_timeout_s``
  (counted in ``rlbus_bus_redelivered_total{topic, reason}``);
- a peer is sent at most ``free - untaken`` messages (its last reported credit less the messages
  whose receipt it has not acknowledged);
- :meth:`Outbox.send` blocks while ``capacity`` messages are not yet taken by a consumer.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bus.codec import encode
from bus.envelope import MAX_ID_CHARS, PeerKey, Send, envelope
from bus.messages import Message
from bus.metrics import BUS_BLOCKED_SECONDS, BUS_QUEUED, BUS_REDELIVERED
from bus.peers import Box

if TYPE_CHECKING:
    from bus.inbox import Inbox


@dataclass
class Entry:
    """A message the outbox holds until it is done downstream."""

    msg_id: str
    seq: int  # send order: re-sends go oldest first
    frames: list[Any]
    nbytes: int
    upstreams: list[tuple["Inbox", str]]  # released when this message is done
    peer: PeerKey | None = None  # the peer it is with (None: pending)
    sent_at: float = 0.0
    taken: bool = False  # its receipt was acknowledged by ``peer``
    sent_to: set[PeerKey] = field(default_factory=set)  # every peer it went to: only they may release it


class Outbox(Box):
    """Sending side of a data topic. A process creates it with :meth:`bus.courier.Courier.sender`.

    Args:
        topic, session, post, stop: see :class:`bus.peers.Box`.
        capacity: most messages not yet taken by a consumer before :meth:`send` blocks.

    Raises:
        ValueError: ``capacity < 1``, or not a data topic.

    Thread-safety: :meth:`send` may be called from any thread (one message at a time per caller);
    every other method but :meth:`unfinished` runs on the box's thread.
    """

    role = "outbox"

    def __init__(self, topic: str, capacity: int, **box: Any) -> None:
        super().__init__(topic, **box)
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.entries: dict[str, Entry] = {}
        self._pending: list[tuple[int, str]] = []  # heap of (seq, id): not with any peer
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._not_taken = 0  # guarded by _cond: queued by send() or in flight, not yet taken
        self._unfinished = 0  # guarded by _cond: sent and not done

    # -- component side ---------------------------------------------------------------------------

    def send(self, msg: Message, *, upstream: tuple["Inbox", str] | None = None, timeout_s: float | None = None) -> bool:
        """Keep ``msg`` until it is done downstream; block while the outbox is full (the wait is
        counted in ``rlbus_bus_blocked_seconds_total{topic}``).

        Args:
            msg: a data message (its ``id`` identifies it end to end).
            upstream: ``(inbox, id)``: call ``inbox.done(id)`` once ``msg`` is done downstream.
            timeout_s: give up after this many seconds (None: until sent or stopped).

        Returns:
            True once the outbox holds the message; False on timeout or stop (not sent).

        Raises:
            TypeError: ``msg`` is not a registered message type (see :func:`bus.codec.encode`).
            ValueError: ``msg.id`` is empty or longer than :data:`MAX_ID_CHARS` (no receiver would take it).
        """
        if not msg.id or len(msg.id) > MAX_ID_CHARS:
            raise ValueError(f"{msg.TYPE} id must be 1..{MAX_ID_CHARS} characters, got {len(msg.id)}")
        frames = encode(msg)
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        with self._cond:
            while self._not_taken >= self.capacity:
                if self.stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    BUS_BLOCKED_SECONDS.labels(self.topic).inc(time.monotonic() - started)
                    return False
                self._cond.wait(0.1)
            self._not_taken += 1
            self._unfinished += 1
        if (waited := time.monotonic() - started) > 0.01:  # backpressure: counted like BusSocket's waits
            BUS_BLOCKED_SECONDS.labels(self.topic).inc(waited)
        nbytes = sum(f.nbytes if hasattr(f, "nbytes") else len(f) for f in frames)
        self.post(self._add, msg.id, frames, nbytes, upstream)
        return True

    def unfinished(self) -> int:
        """Messages sent and not yet done downstream."""
        with self._cond:
            return self._unfinished

    # -- box thread -------------------------------------------------------------------------------

    def _count(self, not_taken: int = 0, unfinished: int = 0) -> None:
        with self._cond:
            self._not_taken += not_taken
            self._unfinished += unfinished
            self._cond.notify_all()

    def _add(self, msg_id: str, frames: list[Any], nbytes: int, upstream: tuple["Inbox", str] | None) -> None:
        upstreams = [upstream] if upstream is not None else []
        if msg_id in self.entries:  # the same message again: one copy travels, both inputs are released with it
            self._count(not_taken=-1, unfinished=-1)
            self.entries[msg_id].upstreams.extend(upstreams)
            return
        entry = Entry(msg_id, next(self._seq), frames, nbytes, upstreams)
        self.entries[msg_id] = entry
        heapq.heappush(self._pending, (entry.seq, msg_id))

    def _unassign(self, entry: Entry) -> None:
        """Take ``entry`` back from its peer into the pending queue."""
        peer = self.peers.get(entry.peer) if entry.peer is not None else None
        if peer is not None:
            peer.untaken.discard(entry.msg_id)
            peer.holding.discard(entry.msg_id)
        if entry.taken:
            self._count(not_taken=1)
        entry.peer, entry.taken = None, False
        heapq.heappush(self._pending, (entry.seq, entry.msg_id))

    def _requeue(self, entry: Entry, reason: str) -> None:
        self._unassign(entry)
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

    def on_frames(self, key: PeerKey, kind: str, session: str, payload: Any, rest: list[Any], now: float) -> None:
        """Take one parsed frame set from peer ``key`` at ``now`` (seconds): credit and receipt /
        done acks (``A``) or a goodbye (``B``). Rejects are counted, never raised."""
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

    def dispatch(self, now: float) -> list[Send]:
        """``D`` frame sets of pending messages for live peers with credit, oldest first (each
        counted as with its peer from ``now``, seconds, until :meth:`unsent` says otherwise)."""
        sends: list[Send] = []
        while self._pending:
            seq, msg_id = self._pending[0]
            entry = self.entries.get(msg_id)
            if entry is None or entry.seq != seq or entry.peer is not None:
                heapq.heappop(self._pending)  # done, or already re-dispatched
                continue
            key = self._pick_peer()
            if key is None:
                break
            heapq.heappop(self._pending)
            peer = self.peers[key]
            first = key not in entry.sent_to
            entry.peer, entry.sent_at = key, now
            entry.sent_to.add(key)
            peer.untaken.add(msg_id)
            peer.holding.add(msg_id)
            frames = [envelope("D", self.session, msg_id), *entry.frames]
            sends.append(Send(key, frames, msg_id=msg_id, nbytes=entry.nbytes, first=first))
        return sends

    def unsent(self, send: Send) -> None:
        """A ``D`` that could not go out: the message is pending again (not a re-send)."""
        entry = self.entries.get(send.msg_id) if send.msg_id is not None else None
        if entry is None or entry.peer != send.key:
            return  # a heartbeat, or already taken back (its peer was lost)
        if send.first:
            entry.sent_to.discard(send.key)
        self._unassign(entry)

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
        """Take back messages whose receipt was not acknowledged within ``ack_timeout_s`` seconds
        at ``now``; the next :meth:`dispatch` re-sends them."""
        for peer in list(self.peers.values()):
            late = [i for i in peer.untaken if now - self.entries[i].sent_at > ack_timeout_s] if peer.untaken else []
            for msg_id in sorted(late, key=lambda i: self.entries[i].seq):
                self._requeue(self.entries[msg_id], "ack_timeout")

    def flush(self, now: float, heartbeat_due: bool) -> list[Send]:
        """Heartbeats (``H``) to every peer and every DEALER endpoint when due; updates the queue gauges."""
        sends: list[Send] = []
        if heartbeat_due:
            hb = envelope("H", self.session, None)
            sends = [Send(key, [hb]) for key in [*self.peers, *self.unknown_dealers()]]
        with self._cond:
            BUS_QUEUED.labels(self.topic, "outbox_not_taken").set(self._not_taken)
            BUS_QUEUED.labels(self.topic, "outbox_unfinished").set(self._unfinished)
        return sends
