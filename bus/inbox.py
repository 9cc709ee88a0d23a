"""Receiving side of a data topic (docs/DELIVERY.md): credit windows, receipt and done acks, duplicates.
:class:`Inbox` is a state machine fed frames and clock ticks by its courier (or a test).

Invariants: each message id comes out of :meth:`Inbox.recv` once (a re-send of a held or recently done id
is acked again and counted as a duplicate); each sender may have ``window`` messages and ``window_bytes``
bytes waiting here (``free = window - queued``; ``empty`` lets one message larger than the byte window
through), so the inbox holds at most ``senders x max(window_bytes, largest message)`` bytes; a done id is
acknowledged to every peer that sent it.
"""

from __future__ import annotations

import collections
import queue
import time
from typing import Any

from bus.codec import decode
from bus.envelope import MAX_IDS_PER_ACK, PeerKey, Send, envelope
from bus.messages import Message
from telemetry.metrics import BUS_BYTES, BUS_DUPLICATES, BUS_MESSAGES, BUS_QUEUED, BUS_QUEUED_BYTES
from bus.peers import Box, Peer
from bus.sockets import frame_bytes
from bus.wire import WireError

DONE_MEMORY = 200_000  # ids remembered as done (a re-send older than that is re-delivered)


class Inbox(Box):
    """Receiving side of a data topic (made by :meth:`bus.courier.Courier.receiver`): ``accept`` the types
    taken, ``window`` / ``window_bytes`` the credit per sender (bytes None: no byte bound). :meth:`recv` and
    :meth:`done` may be called from any thread, the rest runs on the box's thread.

    Raises:
        ValueError: ``window < 1`` or ``window_bytes < 1``, or not a data topic.
    """

    role = "inbox"

    def __init__(
        self, topic: str, accept: tuple[type[Message], ...], window: int, window_bytes: int | None = None, **box: Any
    ) -> None:
        super().__init__(topic, **box)
        if window < 1:
            raise ValueError(f"{topic} inbox: window must be >= 1 message, got {window}")
        if window_bytes is not None and window_bytes < 1:
            raise ValueError(f"{topic} inbox: window_bytes must be >= 1 byte or None, got {window_bytes}")
        self.accept = accept
        self.window = window
        self.window_bytes = window_bytes
        self.queued_bytes = 0  # box thread: bytes waiting in the queue, every sender (the gauge)
        self._queue: queue.Queue[tuple[PeerKey, Peer, Message, int]] = queue.Queue()
        self.held: dict[str, set[PeerKey]] = {}  # ids taken and not done -> who sent them
        self.done_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._due: dict[PeerKey, None] = {}  # peers with acks or credit to send (flush visits only these)

    # -- component side ---------------------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next new message (never a duplicate); None on timeout (``0``: no wait) or once ``stop`` is set.

        Raises:
            bus.peers.CourierFailed: the courier's I/O thread failed (the process should exit).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.raise_if_failed()
            remaining = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            try:
                key, peer, msg, nbytes = (
                    self._queue.get(timeout=max(remaining, 0)) if remaining > 0 else self._queue.get_nowait()
                )
            except queue.Empty:
                if self.stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    return None
                continue
            self.post(self._consumed, key, peer, nbytes)
            return msg

    def done(self, *ids: str) -> None:
        """Release custody of ``ids`` (unknown ids ignored): their senders may forget them.

        Raises:
            bus.peers.CourierFailed: the courier's I/O thread failed (nothing can be released).
        """
        self.raise_if_failed()
        if ids:
            self.post(self.release, ids)

    # -- box thread -------------------------------------------------------------------------------

    def _consumed(self, key: PeerKey, peer: Peer, nbytes: int) -> None:
        self.queued_bytes -= nbytes
        # only the peer that sent it gets the credit back: not a successor under the same key
        # (a restarted sender), whose credit would otherwise grow past the window for good
        if self.peers.get(key) is peer:
            peer.queued -= 1
            peer.queued_bytes -= nbytes
            peer.dirty = True
            self._due[key] = None

    def release(self, ids: tuple[str, ...] | list[str]) -> None:
        """Mark ``ids`` done; the next :meth:`flush` tells whoever sent them."""
        for msg_id in ids:
            senders = self.held.pop(msg_id, None)
            if senders is None:
                continue
            self._remember_done(msg_id)
            for key in senders:
                peer = self.peers.get(key)
                if peer is not None:
                    peer.acks_done.append(msg_id)
                    self._due[key] = None

    def _remember_done(self, msg_id: str) -> None:
        self.done_ids[msg_id] = None
        if len(self.done_ids) > DONE_MEMORY:
            self.done_ids.popitem(last=False)

    def on_frames(self, key: PeerKey, kind: str, session: str, payload: Any, rest: list[Any], now: float) -> None:
        """Take one parsed frame set from peer ``key``; ``rest``: the frames after the envelope. Rejects are
        counted, never raised."""
        if kind == "A" or kind == "B":
            self.reject("wrong_direction", f"{kind} envelope sent to a receiver")
            return
        peer = self.peer_for(key, session, now)
        if kind == "H":
            return
        msg_id: str = payload
        self._due[key] = None  # every path below acknowledges receipt
        nbytes = frame_bytes(rest)  # the sender's Entry.nbytes: what its byte credit counted
        BUS_MESSAGES.labels(self.topic, "recv").inc()
        BUS_BYTES.labels(self.topic, "recv").inc(nbytes)
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
        peer.queued_bytes += nbytes
        self.queued_bytes += nbytes
        peer.acks_taken.append(msg_id)
        self._queue.put((key, peer, msg, nbytes))

    def _credit(self, peer: Peer | None) -> list[Any]:
        """``[free]``, or ``[free, free_bytes, empty]`` with a byte window, for ``peer`` (None: not heard yet)."""
        queued, queued_bytes = (peer.queued, peer.queued_bytes) if peer is not None else (0, 0)
        free = max(self.window - queued, 0)
        if self.window_bytes is None:
            return [free]
        return [free, max(self.window_bytes - queued_bytes, 0), queued == 0]

    def flush(self, now: float, heartbeat_due: bool) -> list[Send]:
        """Pending acks and credit as ``A`` envelopes (heartbeats when due), and a hello with the full window
        to every DEALER endpoint whose sender has not spoken yet."""
        sends: list[Send] = []
        due, self._due = self._due, {}
        # only peers with something to say, unless heartbeats are due: O(busy peers) per wake, not O(peers)
        for key, peer in self.peers.items() if heartbeat_due else [(k, self.peers[k]) for k in due if k in self.peers]:
            beat = heartbeat_due and self.needs_heartbeat(peer, now)  # each idle peer gets its own
            while peer.acks_taken or peer.acks_done or peer.dirty or beat:
                taken, done = peer.acks_taken[:MAX_IDS_PER_ACK], peer.acks_done[:MAX_IDS_PER_ACK]
                del peer.acks_taken[: len(taken)], peer.acks_done[: len(done)]
                free, *byte_credit = self._credit(peer)
                sends.append(Send(key, [envelope("A", self.session, [free, taken, done, *byte_credit])], done=done))
                peer.dirty = beat = False
        if heartbeat_due:
            free, *byte_credit = self._credit(None)
            hello = envelope("A", self.session, [free, [], [], *byte_credit])
            sends.extend(Send(key, [hello]) for key in self.unknown_dealers())
        BUS_QUEUED.labels(self.topic, "inbox").set(self._queue.qsize())
        BUS_QUEUED_BYTES.labels(self.topic, "inbox").set(self.queued_bytes)
        return sends

    def unsent(self, send: Send) -> None:
        """Keep an unsent ack's releases and credit for the next flush (a lost receipt ack costs a re-send)."""
        peer = self.peers.get(send.key)
        if peer is not None:
            peer.acks_done[:0] = send.done
            peer.dirty = True
            self._due[send.key] = None

    def goodbye(self) -> list[Send]:
        """A ``B`` to every sender: it re-sends what this inbox held (on close)."""
        bye = envelope("B", self.session, None)
        return [Send(key, [bye]) for key in self.peers]

    def peer_joined(self, key: PeerKey, peer: Peer) -> None:
        peer.dirty = True  # grant it credit at once
        self._due[key] = None

    def peer_lost(self, key: PeerKey, reason: str) -> None:
        super().peer_lost(key, reason)
        for senders in self.held.values():
            senders.discard(key)
