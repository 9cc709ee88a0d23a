"""Trainer side of re-forming the torch.distributed weight group (the story: docs/ARCHITECTURE.md, "Weights").
A group has a fixed world size, so a joining producer or a dead member means a NEW group: `GroupFormer.form`
binds a fresh rendezvous socket, announces the `Membership` (every `REANNOUNCE_S` while the rendezvous runs on a
helper thread) and, if it times out, moves the members that never acknowledged (all, if every one did) to the
filesystem method and tries again. It reports each `FormAttempt` and never touches the bus. Generations only grow,
one per attempt; `members` and `filesystem` are disjoint; each attempt's socket is bound before it is announced.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from broadcaster.dist_broadcast import Backend, BroadcastSender
from broadcaster.manifest import DEFAULT_BUCKET_BYTES

logger = logging.getLogger(__name__)

REANNOUNCE_S = 2.0
"""How often a group being formed is announced again, seconds."""


@dataclass(frozen=True)
class Membership:
    """`members` (rank `i + 1`) by broadcast, `filesystem` by files, in group `generation` (0: at start)."""

    generation: int
    members: tuple[str, ...]
    filesystem: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [*self.members, *self.filesystem]
        if len(set(names)) != len(names):
            raise ValueError(
                f"members {list(self.members)} and filesystem {list(self.filesystem)} must be "
                "disjoint, without duplicates"
            )

    def next(self, *, add: Iterable[str] = (), drop: Iterable[str] = ()) -> "Membership":
        """The next generation: `add` joins the broadcast members (last), `drop` moves to the filesystem method."""
        add, drop = [p for p in add if p not in self.members], set(drop)
        members = [m for m in (*self.members, *add) if m not in drop]
        filesystem = [p for p in self.filesystem if p not in add and p not in drop] + sorted(drop)
        return Membership(self.generation + 1, tuple(dict.fromkeys(members)), tuple(filesystem))


@dataclass(frozen=True)
class FormAttempt:
    """One `GroupFormer.form` attempt: membership, formed or not, blamed members, seconds, error."""

    membership: Membership
    ok: bool
    blamed: tuple[str, ...]
    seconds: float
    error: str = ""


Announce = Callable[[Membership, str, int], None]
"""`announce(membership, host, port)`: send the `WeightGroup` of one attempt."""
Acked = Callable[[int], set[str]]
"""`acked(generation)`: the producers that acknowledged that generation so far."""


def listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to a free port of `host` and listening (a rendezvous store takes it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


class GroupFormer:
    """Forms the trainer's weight groups after the first at `host`.
    `timeout_s` bounds one attempt's rendezvous and each broadcast in its group, seconds. Raises ValueError:
    `timeout_s <= 0` or an unknown backend."""

    def __init__(
        self, backend: Backend, host: str, *, timeout_s: float, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"reform timeout must be > 0 seconds, got {timeout_s}")
        BroadcastSender(backend, host, 1, 2)  # validates the backend (nothing is opened)
        self.backend, self.host, self.timeout_s, self.bucket_bytes = backend, host, timeout_s, bucket_bytes

    def form(
        self, membership: Membership, announce: Announce, acked: Acked
    ) -> tuple[BroadcastSender | None, Membership, list[FormAttempt]]:
        """Form `membership`'s group, dropping blamed members until one forms or none is left.
        Returns (opened sender or None, the membership formed or the last all-filesystem one (announced too),
        every attempt)."""
        attempts: list[FormAttempt] = []
        while membership.members:
            started = time.perf_counter()
            sock = listening_socket(self.host)
            port = sock.getsockname()[1]
            sender = BroadcastSender(
                self.backend,
                self.host,
                port,
                1 + len(membership.members),
                bucket_bytes=self.bucket_bytes,
                timeout_s=self.timeout_s,
                listen_socket=sock,
            )
            try:
                self._init_announcing(
                    sender, lambda membership=membership, port=port: announce(membership, self.host, port)
                )
            except Exception as exc:
                sender.close()
                acks = acked(membership.generation)
                blamed = tuple(m for m in membership.members if m not in acks) or membership.members
                attempts.append(
                    FormAttempt(
                        membership, False, blamed, time.perf_counter() - started, f"{type(exc).__name__}: {exc}"
                    )
                )
                logger.error(
                    "weight group %d (%s) did not form after %.1f s (%s: %s); %s move(s) to the filesystem method",
                    membership.generation,
                    ", ".join(membership.members),
                    attempts[-1].seconds,
                    type(exc).__name__,
                    exc,
                    ", ".join(blamed),
                )
                membership = membership.next(drop=blamed)
                continue
            attempts.append(FormAttempt(membership, True, (), time.perf_counter() - started))
            logger.info(
                "weight group %d formed: %s by broadcast%s, %.2f s",
                membership.generation,
                ", ".join(membership.members),
                f", {', '.join(membership.filesystem)} by filesystem" if membership.filesystem else "",
                attempts[-1].seconds,
            )
            return sender, membership, attempts
        sock = listening_socket(self.host)  # a valid rendezvous for the announcement; nobody joins it
        try:
            announce(membership, self.host, sock.getsockname()[1])
        finally:
            sock.close()
        return None, membership, attempts

    @staticmethod
    def _init_announcing(sender: BroadcastSender, announce: Callable[[], None]) -> None:
        """`init_group()` on a helper thread, announcing every `REANNOUNCE_S`; raises what it raised."""
        failed: list[BaseException] = []

        def init() -> None:
            try:
                sender.init_group()
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=init, name="weight-group-rendezvous", daemon=True)
        thread.start()  # the socket listens already: members that connect first wait in its backlog
        announce()
        while thread.join(REANNOUNCE_S) is None and thread.is_alive():
            announce()
        if failed:
            raise failed[0]
