"""Trainer side of re-forming the torch.distributed weight group (`broadcaster.dist_broadcast`).

A group has a fixed world size, so a producer that joins (restart, late join, `busctl scale`)
cannot enter the one formed at start, and a member that died makes every later broadcast fail.
Instead of leaving the broadcast method, the trainer forms a NEW group at a version boundary:

    trainer (rank 0)                                   producers
    Membership.next(add=joining)                       (a newcomer asked with weights.wanted)
    GroupFormer.form():
      bind a fresh rendezvous socket (new port)
      announce(membership, host, port) ------------>   WeightGroup(generation, host, port, members)
        (again every REANNOUNCE_S until it formed:     (a producer restarting meanwhile hears it;
         the rendezvous waits on a helper thread)        the others ignore the repeats)
                                        <------------  WeightGroupAck (each member, before joining)
      BroadcastSender(...).init_group()  <-- rendezvous --> BroadcastReceiver.regroup: leave the old
                                                          group, join the new one as rank i + 1
      timed out? blame the members that never acknowledged (all of them if every one did),
      move them to the filesystem method and form again without them.

The caller then re-sends its last version into the new group (`BroadcastReceiver.expects_resend`)
and publishes by filesystem for the producers on that method. Each attempt is reported back
(`FormAttempt`) for the caller's log and metrics; this module never touches the bus.

Invariants:
- generations only grow; each attempt (successful or not) takes the next one;
- `Membership.members` and `Membership.filesystem` are disjoint; a producer is moved to the
  filesystem method only by a failed attempt that blames it, and back only by `next(add=...)`;
- every attempt has its own listening socket (bound before it is announced, so no other process
  can take the port), handed to the rendezvous store or closed.
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
"""How often a group being formed is announced again, seconds (the announcing thread owns the
bus socket; the rendezvous runs on a helper thread)."""


@dataclass(frozen=True)
class Membership:
    """Who takes weights how: `members` (rank `i + 1` each) by broadcast, `filesystem` by the
    filesystem method, in group `generation` (0: the group formed at start)."""

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
        """The membership of the next generation: `add` joins the broadcast members (after the
        current ones; leaving the filesystem list), `drop` moves to the filesystem method."""
        add, drop = [p for p in add if p not in self.members], set(drop)
        members = [m for m in (*self.members, *add) if m not in drop]
        filesystem = [p for p in self.filesystem if p not in add and p not in drop] + sorted(drop)
        return Membership(self.generation + 1, tuple(dict.fromkeys(members)), tuple(filesystem))


@dataclass(frozen=True)
class FormAttempt:
    """One attempt of `GroupFormer.form`: its membership, whether the group formed, the members
    it blamed (failed attempts), how long it took (seconds) and the error (failed attempts)."""

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
    """Forms the trainer's weight groups after the first (see the module docstring).

    Args:
        backend: "auto" | "gloo" | "nccl" (the run's `broadcast.backend`).
        host: the trainer's address for the rendezvous (`broadcast.host`).
        timeout_s: bound on the rendezvous of one attempt and on each broadcast in the group it
            forms (`broadcast.reform_timeout_s`), seconds.
        bucket_bytes: the senders' bucket size (the default on both sides).

    Raises:
        ValueError: `timeout_s <= 0` or an unknown backend.
    """

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
        """Form the group of `membership` (a new generation), blaming and dropping members until
        one forms or none is left.

        Returns (the opened sender, or None when no member is left; the membership that formed,
        or the last one with every member moved to the filesystem method; every attempt made).
        When no member is left the last membership is announced too, so the blamed producers hear
        that they are on the filesystem method.
        """
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
        """`sender.init_group()` on a helper thread while this thread announces the group every
        `REANNOUNCE_S` (a producer that restarts meanwhile hears it too; members ignore repeats).
        Raises what `init_group` raised."""
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
