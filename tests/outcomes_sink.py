"""A stand-in for the prompt source's ledger on the reliable ``outcomes`` topic, for tests of the
components that send outcome reports (packer, trainer, producers).

It receives on a real :class:`bus.inbox.Inbox` (the ROUTER bound at
``Endpoints.address("outcomes")``, as :class:`prompts.proc.PromptSourceProc` binds it)
and does what the ledger does with each message: record it first, then release it with
``done``, at once, or only on :meth:`OutcomesSink.release` with ``hold=True`` (a ledger that has
not recorded it yet), so a test can check what the senders keep meanwhile.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

from bus.messages import GroupsDropped, GroupsTrained, Message
from bus.courier import Courier

T = TypeVar("T")

POLL_S = 0.05
"""How long the receiving thread waits for a message per call, seconds."""


class OutcomesSink:
    """Records every new ``groups.trained`` / ``groups.dropped`` arriving on ``outcomes``.

    Duplicates (a re-sent or re-announced id) are dropped by the inbox itself, as in the prompt
    source, so :meth:`received` holds each message id at most once, in arrival order.

    Args:
        courier: the courier of the simulated prompt-source process; its owner closes it
            (after :meth:`close`).
        endpoint: where to bind, ``Endpoints.address("outcomes")``.
        hold: keep custody of what arrives until :meth:`release` (default: release at once;
            see also :meth:`hold`).

    Raises:
        zmq.ZMQError: the endpoint cannot be bound.
    """

    def __init__(self, courier: Courier, endpoint: str, *, hold: bool = False) -> None:
        self.courier = courier
        self.inbox = courier.receiver("outcomes", endpoint, bind=True, accept=(GroupsDropped, GroupsTrained))
        self._hold = hold
        self._lock = threading.Lock()
        self._received: list[Message] = []
        self._held: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outcomes-sink", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not (self._stop.is_set() or self.courier.stop.is_set()):
            msg = self.inbox.recv(timeout_s=POLL_S)
            if msg is None:
                continue
            with self._lock:  # recorded before done, as the ledger journals before it releases
                self._received.append(msg)
                if self._hold:
                    self._held.append(msg.id)
                    continue
            self.inbox.done(msg.id)

    def received(self, cls: type[Message] | None = None) -> list[Message]:
        """What arrived so far (of type ``cls`` if given), in arrival order; a copy."""
        with self._lock:
            return [m for m in self._received if cls is None or isinstance(m, cls)]

    def ids(self, cls: type[Message] | None = None) -> list[str]:
        """The ids of :meth:`received`."""
        return [m.id for m in self.received(cls)]

    def hold(self) -> None:
        """From now on keep custody of what arrives, until :meth:`release`."""
        with self._lock:
            self._hold = True

    def release(self) -> list[str]:
        """Mark everything held as done (its senders may forget it, and release their own
        upstream custody); from now on arrivals are released at once. Returns the ids released."""
        with self._lock:
            held, self._held, self._hold = self._held, [], False
        self.inbox.done(*held)
        return held

    def wait_for(self, predicate: Callable[["OutcomesSink"], T], what: str, timeout_s: float = 10.0) -> T:
        """Poll ``predicate(self)`` until it is truthy and return its value.

        Raises:
            AssertionError: not within ``timeout_s`` seconds (names ``what`` and what arrived).
        """
        deadline = time.monotonic() + timeout_s
        while not (value := predicate(self)):
            assert time.monotonic() < deadline, f"outcomes sink: {what} not within {timeout_s} s; received {self.ids()}"
            time.sleep(0.01)
        return value

    def close(self) -> None:
        """Stop the receiving thread (the courier stays open: its owner closes it)."""
        self._stop.set()
        self._thread.join(timeout=5)
