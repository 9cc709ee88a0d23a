"""The control hub: an XSUB/XPUB forwarder with a last-value cache.

Publishers connect PUB sockets to the hub's XSUB endpoint; subscribers connect SUB sockets to its
XPUB endpoint. Every valid control message is forwarded to all subscribers. The hub remembers
the latest message of each type in :data:`LAST_VALUE_TYPES` and re-sends them whenever a new
subscription arrives, so a component that joins late learns the current policy version and
weights announcement (the "slow joiner" fix of the ZeroMQ guide). Receivers therefore must treat
control messages idempotently (ignore versions they already have).

Malformed control messages are counted and dropped here, never forwarded.
"""

from __future__ import annotations

import logging
import threading

import zmq

from bus.component import Component, component_main
from bus.messages import Message
from bus.sockets import POLL_SLICE_S, BusSocket

log = logging.getLogger(__name__)

LAST_VALUE_TYPES = ("weights.ready", "trainer.step", "run.done")
"""Control message types whose latest value is re-announced to every new subscriber."""


class ControlHub:
    """Forward control messages from ``pub_endpoint`` (XSUB, bound) to ``sub_endpoint`` (XPUB, bound).

    Args:
        ctx: zmq context. pub_endpoint / sub_endpoint: endpoints to bind.
        stop: event that ends :meth:`run`.
    """

    def __init__(self, ctx: zmq.Context, pub_endpoint: str, sub_endpoint: str, stop: threading.Event) -> None:
        self.stop = stop
        self.inbound = BusSocket(ctx, "control_pub", "recv", pub_endpoint, bind=True, stop=stop)
        self.inbound.sock.send(b"\x01")  # XSUB: subscribe to everything upstream
        self.outbound = BusSocket(ctx, "control_sub", "send", sub_endpoint, bind=True, stop=stop)
        self.outbound.sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.last: dict[str, Message] = {}

    def run(self) -> None:
        """Forward until ``stop`` is set."""
        poller = zmq.Poller()
        poller.register(self.inbound.sock, zmq.POLLIN)
        poller.register(self.outbound.sock, zmq.POLLIN)
        while not self.stop.is_set():
            events = dict(poller.poll(int(POLL_SLICE_S * 1000)))
            if self.inbound.sock in events:
                msg = self.inbound.recv_ready()
                if msg is not None:
                    if msg.TYPE in LAST_VALUE_TYPES:
                        self.last[msg.TYPE] = msg
                    self.outbound.send(msg)
            if self.outbound.sock in events:
                event = self.outbound.sock.recv()
                if event[:1] == b"\x01":  # a new subscription: catch the joiner up
                    for msg in list(self.last.values()):
                        self.outbound.send(msg)

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
