"""A control-channel publisher that re-announces its latest state after the hub restarts.

The control channel is PUB/SUB through the hub (:mod:`bus.hub`): a message published while the
hub is down (killed, being restarted by the supervisor) is dropped by ZeroMQ, and a restarted hub
starts with only the last values it had persisted. Messages that carry *state* (the newest
weights, the trainer's step, the end of the run, the version a producer applied) must not be lost
that way: a producer that missed ``weights.ready`` would sample from old weights until the next
version, a supervisor that missed ``run.done`` would wait forever.

:class:`ControlPublisher` is the PUB socket every component gets from
:meth:`bus.component.Component.control_publisher`. It remembers the latest message of each type
in :data:`REANNOUNCED_TYPES` it sent, and a background thread with a second PUB socket on the same
endpoint watches that socket's connections (a ZeroMQ socket monitor): after every (re)connection to
the hub it re-sends those latest messages at :data:`REANNOUNCE_DELAYS_S` after it (a fresh XSUB's
subscription reaches the PUB side a moment after the connection; PUB drops until then).

Invariants: only idempotent state is re-announced, so receivers must (and do) ignore a version,
step or ``run.done`` they already have. The main socket is used by the component's own thread
only; the thread owns its socket and shares the latest messages under a lock. A re-announcement
can overtake a newer message sent in the same instant on the main socket (two sockets, no order
between them): a receiver may then see the older value after the newer one, until the next
re-send (each reads the latest values anew, so the last one carries the newest).
"""

from __future__ import annotations

import logging
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from bus.messages import Message
from bus.sockets import POLL_SLICE_S, BusSocket

log = logging.getLogger(__name__)

REANNOUNCED_TYPES = ("weights.ready", "trainer.step", "run.done", "weights.applied")
"""Message types whose latest value a publisher re-sends after each connection to the hub."""

REANNOUNCE_DELAYS_S = (0.3, 1.0, 3.0)
"""Seconds after a (re)connection to the hub at which the latest values are re-sent."""


class ControlPublisher(BusSocket):
    """PUB socket on the hub's ``control_pub`` endpoint that re-announces its latest state after
    the hub restarts (see the module docstring). Same arguments as :class:`bus.sockets.BusSocket`
    with topic ``control_pub``, direction ``send``, ``bind=False``.

    Raises:
        zmq.ZMQError: the endpoint cannot be connected.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, *, stop: threading.Event | None = None) -> None:
        super().__init__(ctx, "control_pub", "send", endpoint, bind=False, stop=stop)
        self._latest: dict[str, Message] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.reconnects = 0
        """Connections to the hub after the first one (hub restarts seen), for tests and logs."""
        self._repeater = BusSocket(ctx, "control_pub", "send", endpoint, bind=False, stop=self._closing)
        self._monitor = self._repeater.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._thread = threading.Thread(target=self._reannounce_loop, name="control-reannounce", daemon=True)
        self._thread.start()

    def send(self, msg: Message, timeout_s: float | None = None) -> bool:
        """Publish ``msg`` (never blocks: PUB drops at the HWM); remember it if its type is in
        :data:`REANNOUNCED_TYPES`. Returns True if queued."""
        if msg.TYPE in REANNOUNCED_TYPES:
            with self._lock:
                self._latest[msg.TYPE] = msg
        return super().send(msg, timeout_s)

    def latest(self) -> list[Message]:
        """The latest message of each re-announced type sent so far, oldest type first."""
        with self._lock:
            return list(self._latest.values())

    def _reannounce_loop(self) -> None:
        """Thread: after every connection of the repeater socket, re-send :meth:`latest` at
        :data:`REANNOUNCE_DELAYS_S` after it; until :meth:`close`."""
        due: list[float] = []
        connected_before = lost = False  # lost: a disconnection seen (the first connection's event may
        # come before the monitor is attached, so a reconnection is one after a disconnection too)
        while not self._closing.is_set():
            wait_ms = int(POLL_SLICE_S * 1000)
            if due:
                wait_ms = max(0, min(wait_ms, int((due[0] - time.monotonic()) * 1000)))
            if self._monitor.poll(wait_ms):
                event = recv_monitor_message(self._monitor)
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    lost = True
                elif event["event"] == zmq.EVENT_CONNECTED:
                    if connected_before or lost:
                        self.reconnects += 1
                        log.info(
                            "control hub reconnected (%d): re-announcing %s",
                            self.reconnects,
                            [m.TYPE for m in self.latest()],
                        )
                    connected_before, lost = True, False
                    now = time.monotonic()
                    due = [now + d for d in REANNOUNCE_DELAYS_S]
            while due and time.monotonic() >= due[0]:
                due.pop(0)
                for msg in self.latest():
                    self._repeater.send(msg)

    def close(self) -> None:
        """Stop the re-announcing thread, close both sockets (idempotent)."""
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        try:
            self._repeater.sock.disable_monitor()
        except zmq.ZMQError:
            pass  # already closed
        self._monitor.close(linger=0)
        self._repeater.close()
        super().close()
