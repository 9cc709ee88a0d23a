"""Sending side of a data topic (docs/DELIVERY.md): capacity, dispatch to peers with credit, ack deadlines,
re-sends. :class:`Outbox` is a state machine fed frames and clock ticks by its courier (or a test).

Invariants: a message is kept until a peer it went to says done (a ``done`` from another is a
``foreign_ack`` reject); it is with at most one peer at a time and goes back to the pending queue, oldest
first, when that peer is lost or does not ack within ``ack_timeout_s``; a peer gets at most its message
credit and byte credit less what it has not acknowledged, except that one message of any size goes to a
peer holding none of ours; :meth:`Outbox.send` blocks while ``capacity`` messages or ``capacity_bytes`` are
not taken; the next message goes to the peer with the most byte room, then message room (least recently
chosen among equals, :class:`PeerRanking`), in send order.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bus.codec import encode
from bus.envelope import MAX_CREDIT_BYTES, MAX_ID_CHARS, PeerKey, Send, envelope
from bus.messages import Message
from telemetry.metrics import BUS_BLOCKED_SECONDS, BUS_QUEUED, BUS_QUEUED_BYTES, BUS_REDELIVERED
from bus.peers import Box, Peer
from bus.sockets import frame_bytes

if TYPE_CHECKING:
    from bus.inbox import Inbox


ROOM_SCALE = 1 << 20  # rank = byte room x ROOM_SCALE + message room (message credit <= 1,000,000)
UNBOUNDED_BYTES = MAX_CREDIT_BYTES + 1  # byte room of a peer without a byte bound or holding none of ours


def _bytes_unbounded(peer: Peer) -> bool:
    """``peer`` grants no byte credit, or holds none of our messages (so any size may go)."""
    return peer.free_bytes is None or (peer.empty and not peer.untaken)


def fits(peer: Peer, nbytes: int) -> bool:
    """Whether ``nbytes`` fit ``peer``'s byte credit (message credit is the ranking's)."""
    if _bytes_unbounded(peer):
        return True
    return peer.untaken_bytes + nbytes <= peer.free_bytes


def room_rank(peer: Peer) -> int:
    """0 without message credit or byte room, else ``byte_room * ROOM_SCALE + message_room``."""
    messages = peer.free - len(peer.untaken)
    if messages <= 0:
        return 0
    if _bytes_unbounded(peer):
        byte_room = UNBOUNDED_BYTES
    else:
        byte_room = min(peer.free_bytes - peer.untaken_bytes, MAX_CREDIT_BYTES)
    return byte_room * ROOM_SCALE + messages if byte_room > 0 else 0


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


class PeerRanking:
    """The peers ordered by room for an O(log N) choice: a heap of ``(-room, touched, key)`` with lazy
    deletion (stale entries skipped at the top, rebuilt past :data:`COMPACT_FACTOR` entries per peer).
    ``touched`` counts joins and choices: among equal room the least recently touched wins."""

    COMPACT_FACTOR = 4

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, PeerKey]] = []
        self._rank: dict[PeerKey, tuple[int, int]] = {}  # key -> its current (room, touched)
        self._touch = itertools.count()

    def update(self, key: PeerKey, room: int, *, touch: bool = False) -> None:
        """Record ``key``'s :func:`room_rank`; ``touch``: it joined or was chosen (behind its equals)."""
        current = self._rank.get(key)
        touched = next(self._touch) if touch or current is None else current[1]
        if current == (room, touched):
            return
        self._rank[key] = (room, touched)
        heapq.heappush(self._heap, (-room, touched, key))
        if len(self._heap) > self.COMPACT_FACTOR * len(self._rank) + 64:
            self._heap = [(-r, t, k) for k, (r, t) in self._rank.items()]
            heapq.heapify(self._heap)

    def remove(self, key: PeerKey) -> None:
        """Forget ``key`` (its heap entries become stale)."""
        self._rank.pop(key, None)

    def best(self) -> PeerKey | None:
        """The key with the most room (> 0), least recently touched among equals; None if none has room."""
        while self._heap:
            neg_room, touched, key = self._heap[0]
            if self._rank.get(key) == (-neg_room, touched):
                return key if -neg_room > 0 else None
            heapq.heappop(self._heap)
        return None


class Outbox(Box):
    """Sending side of a data topic (made by :meth:`bus.courier.Courier.sender`). :meth:`send` and
    :meth:`unfinished` may be called from any thread, the rest runs on the box's thread.

    Raises:
        ValueError: ``capacity < 1`` or ``capacity_bytes < 1``, or not a data topic.
    """

    role = "outbox"

    def __init__(self, topic: str, capacity: int, capacity_bytes: int | None = None, **box: Any) -> None:
        super().__init__(topic, **box)
        if capacity < 1:
            raise ValueError(f"{topic} outbox: capacity must be >= 1 message, got {capacity}")
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError(f"{topic} outbox: capacity_bytes must be >= 1 byte or None, got {capacity_bytes}")
        self.capacity = capacity
        self.capacity_bytes = capacity_bytes
        self.entries: dict[str, Entry] = {}
        self._pending: list[tuple[int, str]] = []  # heap of (seq, id): not with any peer
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._not_taken = 0  # guarded by _cond: queued by send() or in flight, not yet taken
        self._unfinished = 0  # guarded by _cond: sent and not done
        self._not_taken_bytes = 0  # guarded by _cond: bytes of the not-taken messages
        self._unfinished_bytes = 0  # guarded by _cond: bytes of the unfinished messages
        self._ranking = PeerRanking()

    # -- component side ---------------------------------------------------------------------------

    def send(
        self, msg: Message, *, upstream: tuple["Inbox", str] | None = None, timeout_s: float | None = None
    ) -> bool:
        """Keep ``msg`` until it is done downstream, blocking while the outbox is full; ``upstream``
        ``(inbox, id)`` is released then. Returns False on timeout (seconds) or stop (not sent).

        Raises:
            TypeError: ``msg`` is not a registered message type (see :func:`bus.codec.encode`).
            ValueError: ``msg.id`` is empty or longer than :data:`MAX_ID_CHARS` (no receiver would take it).
            bus.peers.CourierFailed: the courier's I/O thread failed (the process should exit).
        """
        if not msg.id or len(msg.id) > MAX_ID_CHARS:
            raise ValueError(f"{msg.TYPE} id must be 1..{MAX_ID_CHARS} characters, got {len(msg.id)}")
        self.raise_if_failed()
        frames = encode(msg)
        nbytes = frame_bytes(frames)
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        with self._cond:
            while self._full(nbytes):
                if self.stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    BUS_BLOCKED_SECONDS.labels(self.topic).inc(time.monotonic() - started)
                    return False
                self._cond.wait(0.1)
                self.raise_if_failed()
            self._not_taken += 1
            self._unfinished += 1
            self._not_taken_bytes += nbytes
            self._unfinished_bytes += nbytes
        if (waited := time.monotonic() - started) > 0.01:  # backpressure: counted like BusSocket's waits
            BUS_BLOCKED_SECONDS.labels(self.topic).inc(waited)
        self.post(self._add, msg.id, frames, nbytes, upstream)
        return True

    def _full(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` must wait (hold ``_cond``)."""
        if self._not_taken >= self.capacity:
            return True
        return (
            self.capacity_bytes is not None
            and self._not_taken > 0
            and self._not_taken_bytes + nbytes > self.capacity_bytes
        )

    def unfinished(self) -> int:
        """Messages sent and not yet done downstream."""
        with self._cond:
            return self._unfinished

    # -- box thread -------------------------------------------------------------------------------

    def _count(self, nbytes: int, not_taken: int = 0, unfinished: int = 0) -> None:
        """Add to the counts ``send`` waits on."""
        with self._cond:
            self._not_taken += not_taken
            self._unfinished += unfinished
            self._not_taken_bytes += not_taken * nbytes
            self._unfinished_bytes += unfinished * nbytes
            self._cond.notify_all()

    def _add(self, msg_id: str, frames: list[Any], nbytes: int, upstream: tuple["Inbox", str] | None) -> None:
        upstreams = [upstream] if upstream is not None else []
        if msg_id in self.entries:  # the same message again: one copy travels, both inputs are released with it
            self._count(nbytes, not_taken=-1, unfinished=-1)
            self.entries[msg_id].upstreams.extend(upstreams)
            return
        entry = Entry(msg_id, next(self._seq), frames, nbytes, upstreams)
        self.entries[msg_id] = entry
        heapq.heappush(self._pending, (entry.seq, msg_id))

    def _rerank(self, key: PeerKey, *, touch: bool = False) -> None:
        """Re-rank ``key`` (after every change of its ``free`` or ``untaken``)."""
        self._ranking.update(key, room_rank(self.peers[key]), touch=touch)

    def peer_joined(self, key: PeerKey, peer: Peer) -> None:
        self._ranking.remove(key)  # a successor under a known key starts a new turn
        self._ranking.update(key, room_rank(peer), touch=True)

    @staticmethod
    def _acknowledged(peer: Peer, entry: Entry) -> None:
        """``entry`` is no longer unacknowledged at ``peer`` (no-op if it was not)."""
        if entry.msg_id in peer.untaken:
            peer.untaken.discard(entry.msg_id)
            peer.untaken_bytes -= entry.nbytes

    def _unassign(self, entry: Entry) -> None:
        """Take ``entry`` back from its peer into the pending queue."""
        peer = self.peers.get(entry.peer) if entry.peer is not None else None
        if peer is not None:
            self._acknowledged(peer, entry)
            peer.holding.discard(entry.msg_id)
            self._rerank(entry.peer)
        if entry.taken:
            self._count(entry.nbytes, not_taken=1)
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
        self._ranking.remove(key)
        for msg_id in sorted(peer.holding, key=lambda i: self.entries[i].seq if i in self.entries else -1):
            entry = self.entries.get(msg_id)
            if entry is not None and entry.peer == key:
                self._requeue(entry, reason)

    def on_frames(self, key: PeerKey, kind: str, session: str, payload: Any, rest: list[Any], now: float) -> None:
        """Take an ack (``A``) or goodbye (``B``) from peer ``key``; rejects are counted, never raised."""
        if kind == "D" or kind == "H":
            self.reject("wrong_direction", f"{kind} envelope sent to a sender")
            return
        if kind == "B":
            if key in self.peers:
                self.peer_lost(key, "goodbye")
            return
        peer = self.peer_for(key, session, now)
        free, taken, done = payload[:3]
        peer.free = free
        peer.free_bytes, peer.empty = (payload[3], payload[4]) if len(payload) == 5 else (None, True)
        for msg_id in taken:
            entry = self.entries.get(msg_id)
            if entry is not None and entry.peer == key and not entry.taken:
                entry.taken = True
                self._acknowledged(peer, entry)
                self._count(entry.nbytes, not_taken=-1)
        self._rerank(key)
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
            self._acknowledged(peer, entry)
            peer.holding.discard(msg_id)
            self._rerank(entry.peer)
        self._count(entry.nbytes, not_taken=0 if entry.taken else -1, unfinished=-1)
        for inbox, upstream_id in entry.upstreams:
            inbox.release([upstream_id])

    def dispatch(self, now: float) -> list[Send]:
        """``D`` frame sets of pending messages, oldest first, for the peers with credit."""
        sends: list[Send] = []
        while self._pending:
            seq, msg_id = self._pending[0]
            entry = self.entries.get(msg_id)
            if entry is None or entry.seq != seq or entry.peer is not None:
                heapq.heappop(self._pending)  # done, or already re-dispatched
                continue
            key = self._ranking.best()
            if key is None or not fits(self.peers[key], entry.nbytes):
                break  # the best peer has the most byte room: a message that does not fit it fits none
            heapq.heappop(self._pending)
            peer = self.peers[key]
            first = key not in entry.sent_to
            entry.peer, entry.sent_at = key, now
            entry.sent_to.add(key)
            peer.untaken.add(msg_id)
            peer.untaken_bytes += entry.nbytes
            peer.holding.add(msg_id)
            self._rerank(key, touch=True)  # behind its equals, as the rotation of the old scan did
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

    def check_deadlines(self, now: float, ack_timeout_s: float) -> None:
        """Take back messages not acknowledged within ``ack_timeout_s``; :meth:`dispatch` re-sends them."""
        for peer in list(self.peers.values()):
            late = [i for i in peer.untaken if now - self.entries[i].sent_at > ack_timeout_s] if peer.untaken else []
            for msg_id in sorted(late, key=lambda i: self.entries[i].seq):
                self._requeue(self.entries[msg_id], "ack_timeout")

    def flush(self, now: float, heartbeat_due: bool) -> list[Send]:
        """Heartbeats when due (idle peers, silent DEALER endpoints); updates the queue gauges."""
        sends: list[Send] = []
        if heartbeat_due:
            hb = envelope("H", self.session, None)
            idle = [key for key, peer in self.peers.items() if self.needs_heartbeat(peer, now)]
            sends = [Send(key, [hb]) for key in [*idle, *self.unknown_dealers()]]
        with self._cond:
            BUS_QUEUED.labels(self.topic, "outbox_not_taken").set(self._not_taken)
            BUS_QUEUED.labels(self.topic, "outbox_unfinished").set(self._unfinished)
            BUS_QUEUED_BYTES.labels(self.topic, "outbox_not_taken").set(self._not_taken_bytes)
            BUS_QUEUED_BYTES.labels(self.topic, "outbox_unfinished").set(self._unfinished_bytes)
        return sends
