"""The control-channel publisher every component uses: a PUB socket that remembers its latest message of
each :data:`REANNOUNCED_TYPES` and re-sends them after every (re)connection to the hub (a second PUB socket
whose connections a ZeroMQ monitor thread watches), so state published while the hub was down is not lost
(docs/ARCHITECTURE.md, "Lifecycle and healing"). Receivers ignore values they already have. A re-send can
overtake a newer message of the main socket (two sockets, no order): the next re-send carries the newest.
:class:`Resender` repeats one request every second until it is answered (the supervisor's control requests).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from bus.messages import Message
from bus.sockets import POLL_SLICE_S, BusSocket

log = logging.getLogger(__name__)

REANNOUNCED_TYPES = ("weights.ready", "trainer.step", "run.done", "weights.applied", "run.final_step")  # idempotent
REANNOUNCE_DELAYS_S = (0.3, 1.0, 3.0)  # after each (re)connection: a fresh XSUB subscribes a moment late


class ControlPublisher(BusSocket):
    """PUB socket connected to the hub's ``control_pub`` endpoint, re-announcing after hub restarts.

    Raises:
        zmq.ZMQError: the endpoint cannot be connected.
    """

    def __init__(self, ctx: zmq.Context, endpoint: str, *, stop: threading.Event | None = None) -> None:
        super().__init__(ctx, "control_pub", "send", endpoint, bind=False, stop=stop)
        self._latest: dict[str, Message] = {}
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self.reconnects = 0  # connections to the hub after the first one (hub restarts seen)
        self._repeater = BusSocket(ctx, "control_pub", "send", endpoint, bind=False, stop=self._closing)
        self._monitor = self._repeater.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._thread = threading.Thread(target=self._reannounce_loop, name="control-reannounce", daemon=True)
        self._thread.start()

    def send(self, msg: Message, timeout_s: float | None = None) -> bool:
        """Publish ``msg`` (never blocks: PUB drops at the HWM), remembered if re-announced; True if queued."""
        if msg.TYPE in REANNOUNCED_TYPES:
            with self._lock:
                self._latest[msg.TYPE] = msg
        return super().send(msg, timeout_s)

    def latest(self) -> list[Message]:
        """The latest message of each re-announced type sent so far, oldest type first."""
        with self._lock:
            return list(self._latest.values())

    def _reannounce_loop(self) -> None:
        """Thread: re-send :meth:`latest` at :data:`REANNOUNCE_DELAYS_S` after each connection."""
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


class Resender:
    """Publishes one pending request on the control channel every ``period_s`` until it is answered, through a
    :class:`ControlPublisher` opened on the first send (PUB/SUB may drop any one copy; receivers answer each
    request id once). Used by ``busctl down --finish`` and ``busctl scale servers=N``.

    ``open_publisher``: zero-argument callable returning a :class:`ControlPublisher` at the hub's address now.
    """

    def __init__(self, open_publisher: Callable[[], ControlPublisher], period_s: float = 1.0) -> None:
        self._open, self.period_s = open_publisher, period_s
        self._pub: ControlPublisher | None = None
        self._next_send = 0.0

    def restart(self) -> None:
        """Send at the next :meth:`poll` (a new request)."""
        self._next_send = 0.0

    def poll(self, now: float, msg: Callable[[], Message]) -> None:
        """Publish ``msg()`` if ``period_s`` passed since the last send (``now``: ``time.monotonic()``)."""
        if now < self._next_send:
            return
        if self._pub is None:
            self._pub = self._open()
        self._pub.send(msg())
        self._next_send = now + self.period_s

    def close(self) -> None:
        """Close the publisher (idempotent); the next send reopens it, at the hub's address then."""
        if self._pub is not None:
            self._pub.close()
            self._pub = None
