"""Test peers of the delivery protocol (:mod:`bus.courier`): data messages, hand-made envelopes,
a raw-socket peer that speaks the wire by hand, and a separate peer *process*.

As a process (``python -m reliable_peer MODE ...`` with ``tests/bus`` as the working directory),
it is a real component-like peer that the tests SIGKILL or close gracefully:

- ``recv``: open an :class:`bus.inbox.Inbox` and print ``got ID`` for every message received;
  with ``--done`` release each at once, otherwise hold them (custody kept until killed).
- ``send``: open an :class:`bus.outbox.Outbox`, send ``--count`` messages with ids
  ``PREFIX-0 ...``, print ``sent ID`` for each, then ``unfinished N`` whenever that changes.

Both print ``ready`` once their sockets are open, and close gracefully (goodbye included) when
their stdin reaches end of file. Output is line-buffered: one event per line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from bus import auth
from bus.courier import Courier
from bus.messages import GroupsDropped, GroupsTrained, Message, MicroBatch, Prompt, RolloutGroup, ScoredGroup
from fuzz import envelope, realistic_examples
from wire_frames import frames_of

ACCEPT: dict[str, tuple[type[Message], ...]] = {
    "prompts": (Prompt,),  # producers
    "rollouts": (RolloutGroup,),  # reward workers
    "scored": (ScoredGroup,),  # the packer
    "batches": (MicroBatch,),  # the trainer
    "outcomes": (GroupsDropped, GroupsTrained),  # the prompt source's ledger
}
"""What each data topic's receiver takes (its ``accept``, as the components open it); the first
type is what :func:`data_message` makes."""

FAST = dict(heartbeat_s=0.05, dead_after_s=0.6, ack_timeout_s=3.0)
"""Courier timings of the tests, seconds: heartbeats every 50 ms, a peer silent 0.6 s is dead."""


_examples = functools.cache(realistic_examples)


def data_message(topic: str, msg_id: str) -> Message:
    """A realistic valid message of ``topic``'s type (:func:`fuzz.realistic_examples`) with ``msg_id``."""
    return dataclasses.replace(_examples()[ACCEPT[topic][0].TYPE], id=msg_id)


class RawPeer:
    """A raw ZeroMQ socket speaking the delivery protocol by hand (or sending anything at all).

    A DEALER (connects to a box's ROUTER) or a ROUTER (binds; a box's DEALER connects to it and
    is addressed by the routing id learnt from its first frame set, see :meth:`wait_peer`).
    When ``ctx`` has CURVE (:func:`bus.auth.enable`), the socket uses it like every rlbus socket.

    Args:
        ctx: zmq context. sock_type: ``zmq.DEALER`` or ``zmq.ROUTER``. endpoint: where to
            connect (DEALER) or bind (ROUTER). session: the session string of hand-made envelopes.
    """

    def __init__(self, ctx: zmq.Context, sock_type: int, endpoint: str, session: str = "rawpeer") -> None:
        self.sock = ctx.socket(sock_type)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.router = sock_type == zmq.ROUTER
        self.session = session
        self.routing_id: bytes | None = None
        curve = auth.for_context(ctx)
        if curve is not None:
            curve.secure(self.sock, server=self.router)
        if self.router:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # EAGAIN instead of silent drops
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)

    def recv(self, timeout_s: float) -> tuple[str, str, Any, list[bytes]] | None:
        """The next frame set as ``(kind, session, payload, rest)``, or None after ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        parts = self.sock.recv_multipart()
        if self.router:
            self.routing_id, parts = parts[0], parts[1:]
        _, kind, session, payload = msgpack.unpackb(parts[0], raw=False)
        return kind, session, payload, parts[1:]

    def wait_for(self, kind: str, timeout_s: float, where=lambda payload: True) -> Any:
        """Receive until an envelope of ``kind`` whose payload satisfies ``where``; its payload.

        Raises:
            AssertionError: none within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = self.recv(left)
            if got is not None and got[0] == kind and where(got[2]):
                return got[2]
        raise AssertionError(f"no {kind!r} envelope within {timeout_s} s")

    def wait_peer(self, timeout_s: float = 5.0) -> None:
        """ROUTER: wait for the box's first frame set (a heartbeat or hello) to learn its routing id."""
        deadline = time.monotonic() + timeout_s
        while self.routing_id is None:
            assert time.monotonic() < deadline, f"no box connected to the raw ROUTER within {timeout_s} s"
            self.recv(0.1)

    def send(self, frames: list[bytes], timeout_s: float = 10.0) -> None:
        """Send raw frames (to the learnt routing id on a ROUTER), waiting while the pipe is full."""
        parts = [self.routing_id, *frames] if self.router else frames
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.sock.send_multipart(parts, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                assert time.monotonic() < deadline, f"the box took nothing for {timeout_s} s"
                time.sleep(0.001)

    def send_data(self, msg: Message | list[bytes], msg_id: str | None = None) -> None:
        """A ``D`` envelope with ``msg`` (a message or its frames) under ``msg_id`` (default: its id)."""
        frames = frames_of(msg) if isinstance(msg, Message) else msg
        self.send([envelope("D", self.session, msg_id if msg_id is not None else msg.id), *frames])

    def send_ack(self, free: int, taken: list[str] = (), done: list[str] = ()) -> None:
        """An ``A`` envelope: credit ``free``, receipt of ``taken``, custody released for ``done``."""
        self.send([envelope("A", self.session, [free, list(taken), list(done)])])

    def close(self) -> None:
        self.sock.close(linger=0)


class PeerProcess:
    """``python -m reliable_peer ARGS`` as a child process; waits for its ``ready`` line.

    Args:
        args: the command line after the module name (see the module docstring).
        log_path: where the child's stderr goes (shown when a wait fails).

    Raises:
        AssertionError: the child did not say ``ready`` within 20 s.
    """

    def __init__(self, args: list[str], log_path: Path) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "reliable_peer", *args],
            cwd=Path(__file__).resolve().parent,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.expect("ready", timeout_s=20.0)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def next_line(self, timeout_s: float) -> str | None:
        """The child's next output line, or None if none came within ``timeout_s``."""
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def expect(self, prefix: str, timeout_s: float = 5.0) -> str:
        """Skip output lines until one starts with ``prefix``; the rest of that line (stripped).

        Raises:
            AssertionError: no such line within ``timeout_s`` (the child's stderr is included).
        """
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            line = self.next_line(left)
            if line is not None and line.startswith(prefix):
                return line[len(prefix) :].strip()
        raise AssertionError(
            f"peer {self.args}: no {prefix!r} line within {timeout_s} s (exit code {self.proc.poll()}); "
            f"stderr:\n{self.log_path.read_text()[-3000:]}"
        )

    def kill(self) -> None:
        """SIGKILL the child (no goodbye, no cleanup) and reap it."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> int:
        """Close its stdin (it closes its courier gracefully and exits); its exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


# -- the peer process ----------------------------------------------------------------------------


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a delivery-protocol peer process for tests")
    parser.add_argument("mode", choices=["recv", "send"])
    parser.add_argument("--topic", required=True, choices=sorted(ACCEPT))
    parser.add_argument("--endpoint", required=True, action="append", help="repeat to connect to several")
    parser.add_argument("--bind", action="store_true")
    parser.add_argument("--done", action="store_true", help="recv: release every message at once")
    parser.add_argument("--count", type=int, default=0, help="send: number of messages")
    parser.add_argument("--prefix", default="m", help="send: message id prefix")
    parser.add_argument("--dead-after", type=float, default=FAST["dead_after_s"])
    args = parser.parse_args(argv)

    ctx = zmq.Context()
    courier = Courier(ctx, **{**FAST, "dead_after_s": args.dead_after})
    endpoints = args.endpoint if len(args.endpoint) > 1 else args.endpoint[0]
    stdin_closed = threading.Event()

    def watch_stdin() -> None:
        sys.stdin.read()
        stdin_closed.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        if args.mode == "recv":
            inbox = courier.receiver(args.topic, endpoints, bind=args.bind, accept=ACCEPT[args.topic])
            _say("ready")
            while not stdin_closed.is_set():
                msg = inbox.recv(timeout_s=0.05)
                if msg is not None:
                    _say(f"got {msg.id}")
                    if args.done:
                        inbox.done(msg.id)
        else:
            outbox = courier.sender(args.topic, endpoints, bind=args.bind)
            _say("ready")
            for i in range(args.count):
                msg_id = f"{args.prefix}-{i}"
                while not outbox.send(data_message(args.topic, msg_id), timeout_s=0.1):
                    if stdin_closed.is_set():
                        return 0
                _say(f"sent {msg_id}")
            last = None
            while not stdin_closed.wait(0.05):
                if (n := outbox.unfinished()) != last:
                    _say(f"unfinished {n}")
                    last = n
        return 0
    finally:
        courier.close()
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
