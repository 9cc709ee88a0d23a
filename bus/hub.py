"""The control hub: an XSUB/XPUB forwarder with a last-value cache.

Publishers connect PUB sockets to the hub's XSUB endpoint; subscribers connect SUB sockets to its
XPUB endpoint. Every valid control message is forwarded to all subscribers. The hub remembers
the latest message of each type in :data:`LAST_VALUE_TYPES` and re-sends them whenever a new
subscription arrives, so a component that joins late learns the current policy version and
weights announcement (the "slow joiner" fix of the ZeroMQ guide). Receivers therefore must treat
control messages idempotently (ignore versions they already have).

Malformed control messages, and well-formed messages of a type that is not a control type
(:data:`bus.registry.CONTROL_TYPES`), are counted and dropped here, never forwarded.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import zmq

from bus.component import Component, component_main
from bus.messages import Message
from bus.registry import CONTROL_TYPES
from bus.sockets import POLL_SLICE_S, BusSocket

log = logging.getLogger(__name__)

LAST_VALUE_TYPES = ("weights.ready", "trainer.step", "run.done")
"""Control message types whose latest value is re-announced to every new subscriber."""

REANNOUNCE_INTERVAL_S = 0.05
"""Shortest time between two re-announcements of the cache to new subscribers, seconds."""


class ControlHub:
    """Forward control messages from ``pub_endpoint`` (XSUB, bound) to ``sub_endpoint`` (XPUB, bound).

    Args:
        ctx: zmq context. pub_endpoint / sub_endpoint: endpoints to bind.
        stop: event that ends :meth:`run`.
    """

    def __init__(self, ctx: zmq.Context, pub_endpoint: str, sub_endpoint: str, stop: threading.Event) -> None:
        self.stop = stop
        self.inbound = BusSocket(ctx, "control_pub", "recv", pub_endpoint, bind=True, stop=stop, accept=CONTROL_TYPES)
        self.inbound.sock.send(b"\x01")  # XSUB: subscribe to everything upstream
        self.outbound = BusSocket(ctx, "control_sub", "send", sub_endpoint, bind=True, stop=stop)
        self.outbound.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.last: dict[str, Message] = {}

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
                        self.last[msg.TYPE] = msg
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
    """The control hub as a component process (binds both control endpoints)."""

    def setup(self) -> None:
        self.endpoints.ensure_dirs()
        self.hub = ControlHub(
            self.ctx, self.endpoints.address("control_pub"), self.endpoints.address("control_sub"), self.stop
        )
        self._sockets += [self.hub.inbound, self.hub.outbound]

    def run(self) -> None:
        self.hub.run()


if __name__ == "__main__":
    raise SystemExit(component_main(Hub))
