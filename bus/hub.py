"""The control hub: an XSUB/XPUB forwarder with a last-value cache.

Publishers connect PUB sockets to the hub's XSUB endpoint; subscribers connect SUB sockets to its
XPUB endpoint. Every valid control message is forwarded to all subscribers. The hub remembers
the latest message of each type in :data:`LAST_VALUE_TYPES` (``weights.applied``: the latest of
each producer) and re-sends them whenever a new subscription arrives, so a component that joins
late, or restarts, learns the current policy version, weights announcement and the version every
producer applied (the "slow joiner" fix of the ZeroMQ guide; a prompt source restarted after a
producer applied new weights would otherwise gate issuing on the old version forever). Receivers
therefore must treat control messages idempotently (ignore versions they already have).

Malformed control messages, and well-formed messages of a type that is not a control type
(:data:`bus.registry.CONTROL_TYPES`), are counted and dropped here, never forwarded.

Cost per message: O(1). A message updates one cache slot (a dict keyed by :func:`cache_key`; the
``weights.applied`` slots also sit in an LRU order for the producer cap) and marks the cache dirty;
the file is rewritten at most once per :data:`PERSIST_INTERVAL_S` (and when the hub stops), not
once per message, so N producers announcing ``weights.applied`` each step cost N slot updates and a
few writes, not N scans and N writes of an N-slot file.

Restarts. The hub is restartable (the supervisor restarts it on the same endpoints; every PUB and
SUB reconnects by itself). Its cache survives the restart: changes are written to
``RUN_DIR/hub_last_values.bin`` (:data:`CACHE_NAME`; tmp + rename, so a SIGKILL leaves the old or
the new file, never a torn one; no fsync: a power loss is not covered, as in ``docs/DELIVERY.md``)
within :data:`PERSIST_INTERVAL_S` of the change, and a restarted hub (``RLBUS_RESTARTS >= 1``)
loads it, so subscribers reconnecting to it are caught up again. A change made less than
:data:`PERSIST_INTERVAL_S` before a SIGKILL may be missing from the file: its publisher's
re-announcement (below) restores it, as it does for messages sent while the hub is down. A first start (fresh or ``--resume``d run) deletes the file: a resumed run must not
re-announce the old run's ``run.done``. Messages published while the hub is down are lost by
ZeroMQ; their publishers re-announce their latest state once reconnected
(:class:`bus.control.ControlPublisher`).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from pathlib import Path

import msgpack
import zmq

from bus.codec import decode, encode
from bus.component import Component, component_main
from bus.messages import Message
from bus.registry import CONTROL_TYPES
from bus.sockets import POLL_SLICE_S, BusSocket

log = logging.getLogger(__name__)

LAST_VALUE_TYPES = ("weights.ready", "trainer.step", "run.done", "weights.applied")
"""Control message types whose latest value is re-announced to every new subscriber
(``weights.applied``: per producer, see :func:`cache_key`)."""

CACHE_NAME = "hub_last_values.bin"
"""File in the run dir holding the hub's last-value cache (msgpack list of encoded messages)."""

MAX_CACHED_PRODUCERS = 4096
"""Default most producers whose ``weights.applied`` the cache keeps (the least recently announced
one is dropped first, logged with the count of drops), so a peer inventing producer names cannot
grow the cache without bound. 4096 covers a 1024-GPU run with one producer per GPU four times."""

PERSIST_INTERVAL_S = 0.2
"""Longest time a change of the cache waits before the cache file is rewritten, seconds (the file
is rewritten at most this often, whatever the message rate)."""

REANNOUNCE_INTERVAL_S = 0.05
"""Shortest time between two re-announcements of the cache to new subscribers, seconds."""


def cache_key(msg: Message) -> str:
    """The last-value cache slot of ``msg``: its type, and for ``weights.applied`` also its
    producer (``"weights.applied/producer-1"``): each producer's latest applied version is kept."""
    producer = getattr(msg, "producer", None) if msg.TYPE == "weights.applied" else None
    return msg.TYPE if producer is None else f"{msg.TYPE}/{producer}"


class ControlHub:
    """Forward control messages from ``pub_endpoint`` (XSUB, bound) to ``sub_endpoint`` (XPUB, bound).

    Args:
        ctx: zmq context. pub_endpoint / sub_endpoint: endpoints to bind.
        stop: event that ends :meth:`run` (the cache is persisted once more on the way out).
        cache_path: where the last-value cache is persisted, within :data:`PERSIST_INTERVAL_S` of
            a change (None: memory only). An existing file there is loaded by :meth:`load_cache`,
            not here.
        max_producers: most ``weights.applied`` slots kept (see :data:`MAX_CACHED_PRODUCERS`).

    Raises:
        ValueError: ``max_producers < 1``.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        pub_endpoint: str,
        sub_endpoint: str,
        stop: threading.Event,
        cache_path: Path | None = None,
        max_producers: int = MAX_CACHED_PRODUCERS,
    ) -> None:
        if max_producers < 1:
            raise ValueError(f"max_producers must be >= 1, got {max_producers}")
        self.stop = stop
        self.inbound = BusSocket(ctx, "control_pub", "recv", pub_endpoint, bind=True, stop=stop, accept=CONTROL_TYPES)
        self.inbound.sock.send(b"\x01")  # XSUB: subscribe to everything upstream
        self.outbound = BusSocket(ctx, "control_sub", "send", sub_endpoint, bind=True, stop=stop)
        self.outbound.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.last: dict[str, Message] = {}  # cache_key -> latest message, least recently changed first
        self._applied: collections.OrderedDict[str, None] = collections.OrderedDict()  # LRU of the applied slots
        self.max_producers = max_producers
        self.evicted = 0  # weights.applied slots dropped for the cap
        self.cache_path = cache_path
        self._dirty = False  # the cache changed since it was last persisted
        self._persisted_at = -math.inf

    def load_cache(self) -> int:
        """Load the last values persisted by a previous hub of this run into the cache (a missing
        or unreadable file leaves it empty, with a warning for the latter). Returns how many."""
        if self.cache_path is None or not self.cache_path.is_file():
            return 0
        try:
            frames_list = msgpack.unpackb(self.cache_path.read_bytes())
            loaded = [decode(frames) for frames in frames_list]
        except Exception as exc:
            log.warning("cannot read the hub cache %s (%s): starting with an empty cache", self.cache_path, exc)
            return 0
        for msg in loaded:
            if msg.TYPE in LAST_VALUE_TYPES:
                self._remember(msg)
        self._dirty = False  # the file holds exactly this
        return len(self.last)

    def _remember(self, msg: Message) -> None:
        """Put ``msg`` in its cache slot (most recent last), keeping at most ``max_producers``
        ``weights.applied`` slots. O(1): one slot moved, at most one dropped."""
        key = cache_key(msg)
        self.last.pop(key, None)
        self.last[key] = msg
        self._dirty = True
        if msg.TYPE != "weights.applied":
            return
        self._applied.pop(key, None)
        self._applied[key] = None
        if len(self._applied) > self.max_producers:
            old, _ = self._applied.popitem(last=False)
            del self.last[old]
            self.evicted += 1
            if self.evicted == 1 or self.evicted % 1000 == 0:
                log.warning(
                    "more than %d producers announced weights.applied: %d least recently announced "
                    "dropped from the last-value cache so far (a late joiner does not learn their "
                    "versions until they announce again)",
                    self.max_producers,
                    self.evicted,
                )

    def _persist(self) -> None:
        """Write the cache to ``cache_path`` atomically (tmp + rename) and mark it clean."""
        self._dirty, self._persisted_at = False, time.monotonic()
        if self.cache_path is None:
            return
        data = msgpack.packb([[bytes(f) for f in encode(m)] for m in self.last.values()])
        tmp = self.cache_path.with_name(self.cache_path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.cache_path)

    def _persist_due_in(self, now: float) -> float:
        """Seconds until the dirty cache must be written (``inf``: clean)."""
        return max(0.0, self._persisted_at + PERSIST_INTERVAL_S - now) if self._dirty else math.inf

    def run(self) -> None:
        """Forward until ``stop`` is set.

        New subscriptions are coalesced: the cache is re-sent at most once per
        :data:`REANNOUNCE_INTERVAL_S`, so a peer flooding subscription messages cannot make the
        hub flood every subscriber. A dirty cache is persisted at most once per
        :data:`PERSIST_INTERVAL_S`, and once more when ``stop`` ends the loop.
        """
        try:
            self._forward()
        finally:
            if self._dirty:
                self._persist()

    def _forward(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbound.sock, zmq.POLLIN)
        poller.register(self.outbound.sock, zmq.POLLIN)
        catch_up_due = False
        last_catch_up = -math.inf
        while not self.stop.is_set():
            wait_s = POLL_SLICE_S
            if catch_up_due:
                wait_s = max(0.0, min(wait_s, last_catch_up + REANNOUNCE_INTERVAL_S - time.monotonic()))
            wait_s = min(wait_s, self._persist_due_in(time.monotonic()))
            events = dict(poller.poll(int(wait_s * 1000)))
            if self.inbound.sock in events:
                msg = self.inbound.recv_ready()
                if msg is not None:
                    if msg.TYPE in LAST_VALUE_TYPES:
                        self._remember(msg)
                    self.outbound.send(msg)
            if self.outbound.sock in events:
                event = self.outbound.sock.recv()
                catch_up_due |= event[:1] == b"\x01"  # a new subscription: catch the joiner up
            if catch_up_due and time.monotonic() - last_catch_up >= REANNOUNCE_INTERVAL_S:
                for msg in list(self.last.values()):
                    self.outbound.send(msg)
                catch_up_due, last_catch_up = False, time.monotonic()
            if self._persist_due_in(time.monotonic()) == 0.0:
                self._persist()

    def close(self) -> None:
        self.inbound.close()
        self.outbound.close()


class Hub(Component):
    """The control hub as a component process (binds both control endpoints; the cache persisted
    in the run dir, loaded again after a restart: see the module docstring)."""

    def setup(self) -> None:
        self.endpoints.ensure_dirs()
        cache_path = self.run_dir / CACHE_NAME
        self.hub = ControlHub(
            self.ctx,
            self.endpoints.address("control_pub"),
            self.endpoints.address("control_sub"),
            self.stop,
            cache_path=cache_path,
        )
        if self.launch.restarts >= 1:
            log.info(
                "restarted (%d): %d last value(s) loaded from %s",
                self.launch.restarts,
                self.hub.load_cache(),
                cache_path,
            )
        else:
            cache_path.unlink(missing_ok=True)
        self._sockets += [self.hub.inbound, self.hub.outbound]

    def run(self) -> None:
        self.hub.run()


if __name__ == "__main__":
    raise SystemExit(component_main(Hub))
