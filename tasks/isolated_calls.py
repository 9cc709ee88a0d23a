"""Isolated calls: user functions (reward functions, environments, agents) run in a pool of child
processes, so a call that raises, hangs or crashes its interpreter costs that call, never the caller.

:class:`IsolatedCalls` is shared by :class:`rewards.scorers.IsolatedScorer` and
:class:`tasks.env.EnvCalls`. Functions are named by references resolved in each child (never
pickled); arguments and results are JSON. Why fork+exec and not ``multiprocessing``, the
per-call deadlines and the kill-and-replace rules: docs/ARCHITECTURE.md, "Failure containment".
Messages (one JSON document each, over a ``socketpair``)::

    child start:  ("ready", pid) | ("error", "'ref': ValueError: ...")
    per call:     (fn_index, [args...])  ->  ("ok", JSON value) | ("error", exc_type, message)
    shutdown:     None  (or EOF)

A pool is used from one thread at a time.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

from lifecycle.parent_death import die_with_parent
from tasks.import_path import import_callable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # child start + import + resolve; generous, a loaded host is slow to exec
STOP_TIMEOUT_S = 2.0  # how long close() lets children exit on their own before SIGKILL
MAX_MESSAGE_CHARS = 300  # of an exception message, as logged

_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from tasks.isolated_calls import child_main; child_main(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))"
)

Call = tuple[int, list]  # (function index, JSON arguments)


@dataclasses.dataclass(frozen=True)
class CallResult:
    """``value``: the JSON result (None on error); ``error``: None or the error label; ``message``: what failed
    (the exception's message, at most ``MAX_MESSAGE_CHARS``), ``""`` on success."""

    value: Any
    error: str | None
    message: str = ""


def check_refs(refs: Sequence[str], what: str) -> tuple[str, ...]:
    """``refs`` as a tuple. Raises TypeError for a bare string or a non-str item, ValueError if empty."""
    if isinstance(refs, str) or not all(isinstance(r, str) for r in refs):
        raise TypeError(f"{what} references must be a list of str, got {refs!r}")
    if not refs:
        raise ValueError(f"{what} references are empty: give at least one")
    return tuple(refs)


@dataclasses.dataclass
class _Child:
    proc: subprocess.Popen
    conn: Connection


class IsolatedCalls:
    """``num_procs`` children running the functions named by ``refs``, each resolved in every child by
    ``resolver`` (import path of ``(ref) -> callable``); ``timeout_s`` bounds one call, seconds.
    TypeError: ``refs`` is a string; ValueError: bad arguments or a ref that does not resolve;
    RuntimeError: a child did not start within ``START_TIMEOUT_S``.
    """

    def __init__(
        self, refs: Sequence[str], *, resolver: str, timeout_s: float = 5.0, num_procs: int = 2, what: str = "function"
    ) -> None:
        self.refs = check_refs(refs, what)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if num_procs < 1:
            raise ValueError(f"num_procs={num_procs} must be >= 1")
        self.resolver = resolver
        self.timeout_s = float(timeout_s)
        self.what = what
        self._children: list[_Child] = []
        try:
            for _ in range(num_procs):
                self._children.append(self._start_child())
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> IsolatedCalls:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pids(self) -> list[int]:
        """Process ids of the live children."""
        return [c.proc.pid for c in self._children]

    def run(self, calls: Sequence[Call]) -> list[CallResult]:
        """One :class:`CallResult` per call ``(fn_index, args)``, in order; never raises for a failing
        function. Raises ValueError for an index out of range."""
        assert self._children, "run() after close()"
        bad = [k for k, _ in calls if not 0 <= k < len(self.refs)]
        if bad:
            raise ValueError(f"{self.what} indices {bad} out of range: this pool has {len(self.refs)}")
        results: list[CallResult | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        running: dict[int, tuple[int, float]] = {}  # slot -> (call index, deadline on time.monotonic())
        while pending or running:
            for slot in range(len(self._children)):
                if slot in running or not pending:
                    continue
                if self._children[slot].proc.poll() is not None:  # died while idle: no call to blame
                    log.warning(
                        "%s child pid %d exited (rc %s) while idle; replacing it",
                        self.what,
                        self._children[slot].proc.pid,
                        self._children[slot].proc.returncode,
                    )
                    self._replace(slot)
                c = pending.popleft()
                try:
                    _send(self._children[slot].conn, (calls[c][0], list(calls[c][1])))
                except OSError:  # died between poll() and send()
                    results[c] = self._fail(slot, calls[c][0], c, "crash")
                    continue
                running[slot] = (c, time.monotonic() + self.timeout_s)
            if not running:
                continue
            next_deadline = min(deadline for _, deadline in running.values())
            wait([self._children[s].conn for s in running], timeout=max(0.0, next_deadline - time.monotonic()))
            now = time.monotonic()
            for slot, (c, deadline) in list(running.items()):
                conn = self._children[slot].conn
                if conn.poll(0):  # a reply or EOF; a reply that beat a late check is still taken
                    del running[slot]
                    try:
                        reply = _recv(conn)
                    except (EOFError, OSError):
                        results[c] = self._fail(slot, calls[c][0], c, "crash")
                        continue
                    if reply[0] == "ok":
                        results[c] = CallResult(reply[1], None)
                    else:
                        log.warning(
                            "%s %s raised on call %d: %s: %.300s",
                            self.what,
                            self.refs[calls[c][0]],
                            c,
                            reply[1],
                            reply[2],
                        )
                        results[c] = CallResult(None, reply[1], reply[2] or reply[1])
                elif now >= deadline:
                    del running[slot]
                    results[c] = self._fail(slot, calls[c][0], c, "timeout")
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Stop every child (asked, then SIGKILL after ``STOP_TIMEOUT_S``); idempotent."""
        children, self._children = self._children, []
        for child in children:
            try:
                _send(child.conn, None)
            except OSError:
                pass
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            child.conn.close()

    def _fail(self, slot: int, fn: int, index: int, reason: str) -> CallResult:
        """Log a timeout or crash, replace the child in ``slot``."""
        proc = self._children[slot].proc
        if reason == "timeout":
            log.warning(
                "%s %s ran past timeout_s=%g on call %d; killing child pid %d",
                self.what,
                self.refs[fn],
                self.timeout_s,
                index,
                proc.pid,
            )
        else:
            try:  # EOF usually means it died: reap it for the exit code
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass  # alive but closed its socket: killed below all the same
            log.warning(
                "%s child pid %d died (rc %s) in %s on call %d",
                self.what,
                proc.pid,
                proc.returncode,
                self.refs[fn],
                index,
            )
        self._replace(slot)
        if reason == "timeout":
            return CallResult(None, reason, f"ran past timeout_s={self.timeout_s:g} s (child killed)")
        return CallResult(None, reason, f"its child process died (exit code {proc.returncode})")

    def _replace(self, slot: int) -> None:
        """SIGKILL the child in ``slot`` and start a fresh one."""
        old = self._children[slot]
        old.proc.kill()  # no-op on an exited process
        old.proc.wait()
        old.conn.close()
        self._children[slot] = self._start_child()

    def _start_child(self) -> _Child:
        """Start one child and wait for its handshake."""
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _BOOTSTRAP,
                    json.dumps(sys.path),
                    str(child_sock.fileno()),
                    self.resolver,
                    json.dumps(self.refs),
                ],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,  # stdout/stderr: the worker's, so prints and tracebacks land in its log
            )
        finally:
            child_sock.close()
        child = _Child(proc, Connection(parent_sock.detach()))
        try:
            if not child.conn.poll(START_TIMEOUT_S):
                raise RuntimeError(f"{self.what} child pid {proc.pid} did not start within {START_TIMEOUT_S:g} s")
            try:
                kind, detail = _recv(child.conn)
            except (EOFError, OSError):
                raise RuntimeError(
                    f"{self.what} child pid {proc.pid} exited during startup (rc {proc.wait()})"
                ) from None
            if kind != "ready":
                raise ValueError(f"{self.what} {detail}")
        except BaseException:
            proc.kill()
            proc.wait()
            child.conn.close()
            raise
        return child


def _send(conn: Connection, obj: Any) -> None:
    """Send one JSON message (tuples arrive as lists)."""
    conn.send_bytes(json.dumps(obj).encode())


def _recv(conn: Connection) -> Any:
    """Receive one JSON message; raises EOFError when the other end is gone."""
    return json.loads(conn.recv_bytes())


def child_main(fd: int, resolver: str, refs: list[str]) -> None:
    """The child's loop: resolve ``refs``, handshake, then one call per message until None or EOF."""
    die_with_parent(signal.SIGKILL)  # a hung call ignores anything gentler
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the worker decides
    conn = Connection(fd)
    fns = []
    for ref in refs:
        try:
            fns.append(import_callable(resolver, "resolver")(ref))
        except Exception as exc:
            _send(conn, ("error", f"{ref!r} cannot be loaded: {type(exc).__name__}: {exc}"))
            return
    _send(conn, ("ready", os.getpid()))
    while True:
        try:
            request = _recv(conn)
        except EOFError:
            return
        if request is None:
            return
        k, args = request
        try:
            value = fns[k](*args)
            reply: tuple = ("ok", value)
            encoded = json.dumps(reply).encode()
        except Exception as exc:  # the process boundary: the parent logs and counts it
            encoded = json.dumps(("error", type(exc).__name__, str(exc)[:MAX_MESSAGE_CHARS])).encode()
        conn.send_bytes(encoded)
