"""Per-peer bookkeeping shared by a data topic's inbox and outbox (docs/DELIVERY.md). A peer is known by its
:data:`bus.envelope.PeerKey` and session; it is lost when silent for ``dead_after_s``, saying goodbye,
restarted (new session) or unreachable, each counted by reason. Any frame proves its sender alive, so no
heartbeat goes to a peer sent a frame within ``heartbeat_skip_s`` (half a heartbeat period).

Invariants: one thread drives a box (its courier's I/O thread, or a test); a box holds no socket and starts
no thread; ``post`` runs a function on that thread (the default, :func:`call_now`, at once).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from bus.envelope import PeerKey, Send
from telemetry.metrics import BUS_PEER_DEATHS, BUS_REJECTED, declare_topic
from bus.topics import TOPICS

log = logging.getLogger(__name__)


def call_now(fn: Callable[..., Any], *args: Any) -> None:
    """The default ``post`` of a box without a courier: run ``fn(*args)`` at once."""
    fn(*args)


@dataclass
class Peer:
    """What a box knows of one peer (sender-side fields for an outbox, receiver-side for an inbox)."""

    session: str
    last_seen: float
    free: int = 0  # sender side: credit the receiver last reported, messages
    free_bytes: int | None = None  # sender side: byte credit it last reported (None: it grants no byte bound)
    empty: bool = True  # sender side: it last reported holding none of our messages (one of any size may go)
    untaken_bytes: int = 0  # sender side: bytes of the messages in ``untaken``
    untaken: set[str] = field(default_factory=set)  # sender side: sent, receipt not yet acknowledged
    holding: set[str] = field(default_factory=set)  # sender side: sent and not done
    queued: int = 0  # receiver side: its messages waiting in the inbox
    queued_bytes: int = 0  # receiver side: their bytes (message frames)
    acks_taken: list[str] = field(default_factory=list)  # receiver side: to acknowledge
    acks_done: list[str] = field(default_factory=list)
    dirty: bool = False  # receiver side: credit changed, tell the sender
    last_sent: float = -math.inf  # when a frame last went out to it (set by the courier), seconds


class CourierFailed(RuntimeError):
    """The courier's I/O thread gave up after too many errors in a row: raised by the boxes' blocking calls,
    it ends the component (exit 1) so the supervisor restarts it and its peers re-send what it held."""


class Box:
    """What an inbox and an outbox share: topic, session (this courier's), peers, DEALER links, rejects;
    ``post`` runs a function on the box's thread; ``stop`` ends blocking component calls early.

    Raises:
        ValueError: ``topic`` is not a data topic.
    """

    role = ""

    def __init__(
        self,
        topic: str,
        *,
        session: str,
        post: Callable[..., None] = call_now,
        stop: threading.Event | None = None,
    ) -> None:
        if topic not in TOPICS or not TOPICS[topic].reliable:
            raise ValueError(
                f"{topic!r} is not a data topic; data topics: {sorted(t for t, s in TOPICS.items() if s.reliable)}"
            )
        self.topic = topic
        self.session = session
        self.post = post
        self.stop = stop or threading.Event()
        self.dealer_links: list[int] = []  # link numbers of DEALERs: one peer each, greeted before it speaks
        self.peers: dict[PeerKey, Peer] = {}
        self.heartbeat_skip_s = 0.0  # no heartbeat to a peer sent a frame this recently (0: always beat)
        self._rejected_reasons: set[str] = set()
        self.failure: BaseException | None = None  # set by the courier when its I/O thread fails
        declare_topic(topic, "recv" if self.role == "inbox" else "send", reliable=True)

    def raise_if_failed(self) -> None:
        """Raise :class:`CourierFailed` once the courier has failed (any thread)."""
        if self.failure is not None:
            raise CourierFailed(
                f"the courier of this process failed ({type(self.failure).__name__}: {self.failure}); "
                f"{self.role} of {self.topic} is closed"
            ) from self.failure

    def reject(self, reason: str, detail: str) -> None:
        """Count a dropped frame set and log the first one of each reason."""
        BUS_REJECTED.labels(self.topic, reason).inc()
        if reason not in self._rejected_reasons:
            self._rejected_reasons.add(reason)
            log.warning("rejected a message on %s (%s); further ones are only counted", self.topic, detail)

    def peer_for(self, key: PeerKey, session: str, now: float) -> Peer:
        """The peer of ``key``, seen at ``now``; a new session on a known key means it restarted."""
        peer = self.peers.get(key)
        if peer is not None and peer.session != session:
            self.peer_lost(key, "restarted")
            peer = None
        if peer is None:
            peer = self.peers[key] = Peer(session=session, last_seen=now)
            self.peer_joined(key, peer)
        peer.last_seen = now
        return peer

    def needs_heartbeat(self, peer: Peer, now: float) -> bool:
        """Nothing was sent to ``peer`` within ``heartbeat_skip_s``."""
        return now - peer.last_sent >= self.heartbeat_skip_s

    def unknown_dealers(self) -> list[PeerKey]:
        """DEALER links whose peer has not spoken yet (greeted on every heartbeat)."""
        return [(n, b"") for n in self.dealer_links if (n, b"") not in self.peers]

    def expire(self, now: float, dead_after_s: float) -> None:
        """Lose every peer silent for more than ``dead_after_s``."""
        for key, peer in list(self.peers.items()):
            if now - peer.last_seen > dead_after_s:
                self.peer_lost(key, "silent")

    def peer_joined(self, key: PeerKey, peer: Peer) -> None:
        """Hook: a new peer spoke first."""

    def peer_lost(self, key: PeerKey, reason: str) -> None:
        """Forget a peer (dead, restarted or gone); subclasses re-send what it held."""
        if self.peers.pop(key, None) is not None:
            BUS_PEER_DEATHS.labels(self.topic, reason).inc()
            log.info("%s: peer %s of %s lost (%s)", self.role, key, self.topic, reason)

    def unsent(self, send: Send) -> None:
        """Hook: ``send`` (returned by this box) could not go out now; undo what it changed."""
