"""The control hub: an XSUB/XPUB forwarder of control messages with a last-value cache, re-sent to every new
subscription so a late or restarted component learns the current weights, step and each producer's applied
version (receivers are idempotent). Malformed messages and non-control types are counted and dropped.

The cache costs O(1) per message and is written (tmp + rename, no fsync) to :data:`CACHE_NAME` at most every
:data:`PERSIST_INTERVAL_S`; a restarted hub reloads it, a first start (fresh or ``--resume``) deletes it, so a
resumed run never re-announces the old ``run.done``. What a SIGKILL or a down hub loses, the publishers'
re-announcements restore (:mod:`bus.control`; docs/ARCHITECTURE.md, "Lifecycle and healing").
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

LAST_VALUE_TYPES = (
    "weights.ready",
    "trainer.step",
    "run.done",
    "weights.applied",
    "run.final_step",
    "servers.wanted",
)  # to new subscribers
CACHE_NAME = "hub_last_values.bin"  # in the run dir: a msgpack list of encoded messages
MAX_CACHED_PRODUCERS = 4096  # LRU cap of weights.applied slots (a 1024-GPU run's producers four times)
PERSIST_INTERVAL_S = 0.2  # the cache file is rewritten at most this often, seconds
REANNOUNCE_INTERVAL_S = 0.05  # the cache is re-sent to new subscribers at most this often, seconds


def cache_key(msg: Message) -> str:
    """The cache slot of ``msg``: its type, for ``weights.applied`` with its producer (``weights.applied/p-1``)."""
    producer = getattr(msg, "producer", None) if msg.TYPE == "weights.applied" else None
    return msg.TYPE if producer is None else f"{msg.TYPE}/{producer}"


class ControlHub:
    """Forward control messages from ``pub_endpoint`` (XSUB) to ``sub_endpoint`` (XPUB), both bound, until
    ``stop``; the cache persists to ``cache_path`` (None: memory only), read back by :meth:`load_cache`.

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
        """Load a previous hub's persisted values (unreadable: empty, with a warning); returns how many."""
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
        """Put ``msg`` in its slot (most recent last), evicting the oldest applied slot past the cap; O(1)."""
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
        """Write the cache atomically (tmp + rename) and mark it clean."""
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
        """Forward until ``stop``; new subscriptions are coalesced (a subscription flood cannot become a
        flood to every subscriber); a dirty cache is persisted on the way out."""
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
    """The control hub as a component process (a restart reloads the cache, a first start deletes it)."""

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
