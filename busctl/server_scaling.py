"""``busctl scale servers=N``: resize the inference servers each producer starts (``producers.engine: server``).

The request rides in ``scale.json`` with the replica counts (:mod:`busctl.scaling`); the supervisor publishes
:class:`ServersWanted` on the control channel until every producer answers :class:`ServersScaled` for it (the hub
keeps the last one, so a producer restarted or added later starts as many). Each producer adds servers, which
replay the last weight update before they sample, or drains and stops its last ones
(``ServerEngine.resize``). Servers attached by URL (``producers.servers``) are the user's to scale.
"""

from __future__ import annotations

from typing import Callable

from bus.control import ControlPublisher, Resender
from bus.messages import ServersScaled, ServersWanted

__all__ = ["MAX_SERVERS", "ServerRequests", "check_attached_producers", "check_servers_request"]

MAX_SERVERS = 64
"""Most servers one producer may start (``producers.servers_per_replica``'s bound)."""


def check_servers_request(cfg, n: object) -> int:
    """``n`` for ``servers=N`` on the run ``cfg``. ValueError: not an int in 1..:data:`MAX_SERVERS`, producers not on
    servers they start, the broadcast method (one server per producer)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_SERVERS:
        raise ValueError(f"servers={n!r}: need a whole number from 1 to {MAX_SERVERS} (servers per producer)")
    if cfg.producers.engine != "server":
        raise ValueError("servers=N needs producers.engine: server (this run's producers embed vLLM)")
    if cfg.producers.servers:
        raise ValueError("servers=N resizes the servers producers start; this run's are attached by producers.servers")
    if cfg.broadcast.method == "broadcast" and n != 1:
        raise ValueError("servers=N: broadcast.method broadcast takes one server per producer (one rank each)")
    return n


def check_attached_producers(cfg, n: int) -> None:
    """ValueError for ``producers=N`` above ``producers.replicas`` when servers are attached: each producer drives
    its own share of ``producers.servers`` (``producers.engines.attached_servers``), fixed at start."""
    if cfg.producers.engine == "server" and cfg.producers.servers and n > cfg.producers.replicas:
        raise ValueError(
            f"producers={n}: the {len(cfg.producers.servers)} producers.servers are split among the run's "
            f"producers.replicas={cfg.producers.replicas} producers; restart the run with more replicas to add some"
        )


class ServerRequests:
    """The supervisor's side of one ``servers=N`` request at a time, published every second (``resender``) while
    a producer has not answered. ``open_publisher``: returns a :class:`ControlPublisher` (opened on the first send)."""

    def __init__(self, open_publisher: Callable[[], ControlPublisher]) -> None:
        self.resender = Resender(open_publisher)
        self.request: tuple[str, int] | None = None  # (id, servers)
        self.answers: dict[str, ServersScaled] = {}  # producer -> its answer to the request

    def start(self, rid: str, servers: int) -> None:
        """A new request: forget the previous one's answers, send at the next :meth:`poll`."""
        self.request, self.answers = (rid, servers), {}
        self.resender.restart()

    def on_answer(self, msg: ServersScaled) -> None:
        """Keep a producer's answer to the current request."""
        if self.request is not None and msg.request == self.request[0]:
            self.answers[msg.producer] = msg

    def outcome(self, producers: list[str]) -> tuple[bool, str]:
        """(every one of ``producers`` answered, the first error or "")."""
        errors = [f"{p}: {self.answers[p].error}" for p in producers if p in self.answers and self.answers[p].error]
        return all(p in self.answers for p in producers), (errors[0] if errors else "")

    def poll(self, now: float, producers: list[str]) -> None:
        """Publish the request if due while one of ``producers`` has not answered it."""
        if self.request is not None and not all(p in self.answers for p in producers):
            rid, servers = self.request
            self.resender.poll(now, lambda: ServersWanted(id=rid, servers=servers))

    def close(self) -> None:
        """Close the publisher (reopened at the hub's address on the next send)."""
        self.resender.close()
