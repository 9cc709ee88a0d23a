"""``busctl scale servers=N``: resize the inference servers each producer starts (``producers.engine: server``).

The request rides in ``scale.json`` with the replica counts (:mod:`busctl.scaling`); the supervisor publishes
:class:`ServersWanted` on the control channel until every producer answers :class:`ServersScaled` for it (the hub
keeps the last one, so a producer restarted or added later starts as many). Each producer adds servers, which
replay the last weight update before they sample, or drains and stops its last ones
(``ServerEngine.resize``). Servers attached by URL (``producers.servers``) are the user's to scale.
"""

from __future__ import annotations

from typing import Callable

from bus.control import ControlPublisher
from bus.messages import ServersScaled, ServersWanted

__all__ = ["MAX_SERVERS", "RESEND_S", "ServerRequests", "check_servers_request"]

MAX_SERVERS = 64
"""Most servers one producer may start (``producers.servers_per_replica``'s bound)."""

RESEND_S = 1.0
"""Period of :class:`ServersWanted` while a producer has not answered (PUB/SUB may drop one), seconds."""


def check_servers_request(cfg, n: object) -> int:
    """``n`` for ``servers=N`` on the run ``cfg``. ValueError: not an int in 1..:data:`MAX_SERVERS`, producers not on
    servers they start."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SERVERS:
        raise ValueError(f"servers={n!r}: need a whole number from 1 to {MAX_SERVERS} (servers per producer)")
    if cfg.producers.engine != "server":
        raise ValueError("servers=N needs producers.engine: server (this run's producers embed vLLM)")
    if cfg.producers.servers:
        raise ValueError("servers=N resizes the servers producers start; this run's are attached by producers.servers")
    return n


class ServerRequests:
    """The supervisor's side of one ``servers=N`` request at a time. ``publisher``: a zero-argument callable
    returning a :class:`ControlPublisher` (opened on the first send)."""

    def __init__(self, publisher: Callable[[], ControlPublisher]) -> None:
        self._open = publisher
        self._pub: ControlPublisher | None = None
        self._next_send = 0.0
        self.request: tuple[str, int] | None = None  # (id, servers)
        self.answers: dict[str, ServersScaled] = {}  # producer -> its answer to the request

    def start(self, rid: str, servers: int) -> None:
        """A new request: forget the previous one's answers, send at the next :meth:`poll`."""
        self.request, self.answers, self._next_send = (rid, servers), {}, 0.0

    def on_answer(self, msg: ServersScaled) -> None:
        """Keep a producer's answer to the current request."""
        if self.request is not None and msg.request == self.request[0]:
            self.answers[msg.producer] = msg

    def outcome(self, producers: list[str]) -> tuple[bool, str]:
        """(every one of ``producers`` answered, the first error or "")."""
        errors = [f"{p}: {self.answers[p].error}" for p in producers if p in self.answers and self.answers[p].error]
        return all(p in self.answers for p in producers), (errors[0] if errors else "")

    def poll(self, now: float, producers: list[str]) -> None:
        """Publish the request every :data:`RESEND_S` while one of ``producers`` has not answered it."""
        if self.request is None or now < self._next_send or all(p in self.answers for p in producers):
            return
        if self._pub is None:
            self._pub = self._open()
        rid, servers = self.request
        self._pub.send(ServersWanted(id=rid, servers=servers))
        self._next_send = now + RESEND_S

    def close(self) -> None:
        """Close the publisher (reopened at the hub's address on the next send)."""
        if self._pub is not None:
            self._pub.close()
            self._pub = None
