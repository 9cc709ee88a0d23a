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

Restarts. The hub is restartable (the supervisor restarts it on the same endpoints; every PUB and
SUB reconnects by itself). Its cache survives the restart: every change is written to
``RUN_DIR/hub_last_values.bin`` (:data:`CACHE_NAME`; tmp + rename, so a SIGKILL leaves the old or
the new file, never a torn one; no fsync: a power loss is not covered, as in ``docs/DELIVERY.md``),
and a restarted hub (``RLBUS_RESTARTS >= 1``) loads it, so subscribers reconnecting to it are
caught up again. A first start (fresh or ``--resume``d run) deletes the file: a resumed run must not
re-announce the old run's ``run.done``. Messages published while the hub is down are lost by
ZeroMQ; their publishers re-announce their latest state once reconnected
(:class:`bus.control.ControlPublisher`).
"""

from __future__ import annotations

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

MAX_CACHED_PRODUCERS = 256
"""Most producers whose ``weights.applied`` the cache keeps (the least recently announced one is
dropped first), so a peer inventing producer names cannot grow the cache without bound."""

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
        stop: event that ends :meth:`run`.
        cache_path: where the last-value cache is persisted on every change (None: memory only).
            An existing file there is loaded by :meth:`load_cache`, not here.
    """

    def __init__(self, ctx: zmq.Context, pub_endpoint: str, sub_endpoint: str, stop: threading.Event,
                 cache_path: Path | None = None) -> None:
        self.stop = stop
        self.inbound = BusSocket(ctx, "control_pub", "recv", pub_endpoint, bind=True, stop=stop, accept=CONTROL_TYPES)
        self.inbound.sock.send(b"\x01")  # XSUB: subscribe to everything upstream
        self.outbound = BusSocket(ctx, "control_sub", "send", sub_endpoint, bind=True, stop=stop)
        self.outbound.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.last: dict[str, Message] = {}
        self.cache_path = cache_path

    def load_cache(self) -> int:
        """Load the last values persisted by a previous hub of this run into the cache (a missing
        or unreadable file leaves it empty, with a warning for the latter). Returns how many."""
        if self.cache_path is None or not self.cache_path.is_file():
            return 0
        try:
            frames_list = msgpack.unpackb(self.cache_path.read_bytes())
            loaded = [decode(frames) for frames in frames_list]
        except Exception as exc:  # noqa: BLE001 - any corruption: start empty, say so
            log.warning("cannot read the hub cache %s (%s): starting with an empty cache", self.cache_path, exc)
            return 0
        for msg in loaded:
            if msg.TYPE in LAST_VALUE_TYPES:
                self._remember(msg)
        return len(self.last)

    def _remember(self, msg: Message) -> None:
        """Put ``msg`` in its cache slot (most recent last), keeping at most
        :data:`MAX_CACHED_PRODUCERS` ``weights.applied`` slots."""
        key = cache_key(msg)
        self.last.pop(key, None)
        self.last[key] = msg
        applied = [k for k in self.last if k.startswith("weights.applied/")]
        for old in applied[: max(0, len(applied) - MAX_CACHED_PRODUCERS)]:
            del self.last[old]

    def _persist(self) -> None:
        """Write the cache to ``cache_path`` atomically (tmp + rename)."""
        if self.cache_path is None:
            return
        data = msgpack.packb([[bytes(f) for f in encode(m)] for m in self.last.values()])
        tmp = self.cache_path.with_name(self.cache_path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, self.cache_path)

    def run(self) -> None:
        """Forward until ``stop`` is set.

        New subscriptions are coalesced: the cache is re-sent at most once per
        :data:`REANNOUNCE_INTERVAL_S`, so a peer flooding subscription messages cannot make the
        hub flood every subscriber.
        """
        poller = zmq.Poller()
        poller.register(self.inbound.sock, zmq.POLLIN)
        poller.register(self.outbound.sock, zmq.POLLIN)
        catch_up_due = False
        last_catch_up = -math.inf
        while not self.stop.is_set():
            wait_s = POLL_SLICE_S
            if catch_up_due:
                wait_s = max(0.0, min(wait_s, last_catch_up + REANNOUNCE_INTERVAL_S - time.monotonic()))
            events = dict(poller.poll(int(wait_s * 1000)))
            if self.inbound.sock in events:
                msg = self.inbound.recv_ready()
                if msg is not None:
                    if msg.TYPE in LAST_VALUE_TYPES:
                        self._remember(msg)
                        self._persist()
                    self.outbound.send(msg)
            if self.outbound.sock in events:
                event = self.outbound.sock.recv()
                catch_up_due |= event[:1] == b"\x01"  # a new subscription: catch the joiner up
            if catch_up_due and time.monotonic() - last_catch_up >= REANNOUNCE_INTERVAL_S:
                for msg in list(self.last.values()):
                    self.outbound.send(msg)
                catch_up_due, last_catch_up = False, time.monotonic()

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
            self.ctx, self.endpoints.address("control_pub"), self.endpoints.address("control_sub"), self.stop,
            cache_path=cache_path,
        )
        if self.launch.restarts >= 1:
            log.info("restarted (%d): %d last value(s) loaded from %s", self.launch.restarts, self.hub.load_cache(), cache_path)
        else:
            cache_path.unlink(missing_ok=True)
        self._sockets += [self.hub.inbound, self.hub.outbound]

    def run(self) -> None:
        self.hub.run()


if __name__ == "__main__":
    raise SystemExit(component_main(Hub))
