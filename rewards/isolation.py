"""Reward isolation: run the reward function in child processes, so a bad one costs a sample, not a worker.

A reward function is user code (a verifier, a sandbox call, a regex over model output). One that
raises, hangs, runs past ``timeout_s``, crashes its interpreter (``os._exit``, a segfault) or returns
NaN must score that sample 0 with the reason counted, and the reward worker must live on.

:class:`IsolatedScorer` keeps a small pool of ``num_procs`` children of its own. Each child is
``python -c <bootstrap>`` started with :mod:`subprocess` (fork+exec, safe from a threaded parent),
talks over one ``socketpair`` framed by :class:`multiprocessing.connection.Connection`, and imports
only this module and the registry (~30 ms to start, ~15 MB). Not ``multiprocessing``'s "spawn" or
"forkserver" contexts: those re-run the parent's ``__main__`` module (``rewards.worker``: zmq,
numpy, prometheus; ~0.2 s and ~50 MB per child, paid again on every restart) and leave a forkserver
/ resource-tracker process behind; not ``ProcessPoolExecutor``: it cannot kill one stuck worker.

Protocol (parent -> child, child -> parent), one JSON document per message (no pickle):

    child start:  ("ready", pid) | ("error", "ValueError: unknown reward ...")   # resolve handshake
    per sample:   (completion, info)  ->  ("ok", float) | ("error", exc_type, message)
    shutdown:     None  (or the parent's end closing: EOF)

Invariants and choices:

* **Per-sample calls, each with its own deadline.** :meth:`IsolatedScorer.score` takes a whole
  group, hands one sample at a time to each idle child and waits on all of them together; a
  sample's deadline starts when it is handed to a child (not when the group arrives), so only the
  sample that overran is zeroed. A group of G samples therefore takes at most about
  ``ceil(G / num_procs) * timeout_s`` even if every sample hangs.
* **A child that overruns is SIGKILLed and replaced** before the next sample is handed out, so a
  hung function never keeps a slot. A child found dead (EOF on its socket: ``os._exit``, segfault,
  OOM kill) scores its sample 0 as ``"crash"`` and is replaced; one found dead while idle is
  replaced without charging any sample.
* **Error labels:** the exception type name (``"ValueError"``), ``"timeout"``, ``"crash"``,
  ``"non_finite"``. The scorer returns them per sample; :class:`rewards.worker.RewardWorker` counts
  them in ``rlbus_rewards_errors_total{error=...}``.
* **Functions are named, never pickled:** a registry name or an import path
  ``"package.module:function"`` (see :func:`rewards.registry.get_reward_fn`), resolved inside the
  child. An import path executes code named by the run config, which is trusted; a reference never
  comes from the bus.
* Children ask Linux to SIGKILL them when the thread that started them exits (``PR_SET_PDEATHSIG``),
  so a hung child cannot outlive a reward worker that was killed; a live parent ends them with
  :meth:`IsolatedScorer.close`. A scorer is used from one thread (the worker's main loop).

:class:`InProcessScorer` has the same interface and calls the function directly (no timeout, no
crash protection): for tests and benchmarks (``rewards.isolate: false``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
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

from rewards.registry import get_reward_fn

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # child start + import + resolve; generous, a loaded host is slow to exec
STOP_TIMEOUT_S = 2.0  # how long close() lets children exit on their own before SIGKILL
MAX_MESSAGE_CHARS = 300  # of an exception message, as logged

_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from rewards.isolation import child_main; child_main(int(sys.argv[2]), sys.argv[3])"
)


@dataclasses.dataclass(frozen=True)
class GroupScore:
    """Rewards of one group: ``rewards[i]`` (0.0 where ``errors[i]`` is set) and ``errors[i]``
    (``None`` or the error label of sample i: exception type, ``"timeout"``, ``"crash"``, ``"non_finite"``)."""

    rewards: list[float]
    errors: list[str | None]


def _finite(value: float) -> tuple[float, str | None]:
    """``(value, None)`` for a finite reward, ``(0.0, "non_finite")`` for NaN or +-inf."""
    return (value, None) if math.isfinite(value) else (0.0, "non_finite")


class InProcessScorer:
    """Calls the reward function in this process: exceptions and NaN score 0, hangs and crashes don't
    (no isolation). Same interface as :class:`IsolatedScorer`.

    Raises:
        ValueError: unknown reward name or import path.
    """

    def __init__(self, reward_fn: str) -> None:
        self.reward_fn = get_reward_fn(reward_fn)

    def score(self, completions: Sequence[str], info: dict[str, Any]) -> GroupScore:
        rewards: list[float] = []
        errors: list[str | None] = []
        for i, text in enumerate(completions):
            try:
                reward, error = _finite(float(self.reward_fn(text, info)))
            except Exception as exc:
                log.warning("reward function raised on sample %d: %s: %.300s; reward set to 0", i, type(exc).__name__, exc)
                reward, error = 0.0, type(exc).__name__
            rewards.append(reward)
            errors.append(error)
        return GroupScore(rewards, errors)

    def close(self) -> None:
        """Nothing to release."""


@dataclasses.dataclass
class _Child:
    proc: subprocess.Popen
    conn: Connection


class IsolatedScorer:
    """Scores groups with a reward function that runs in ``num_procs`` child processes.

    Args:
        reward_fn: a registry name or ``"package.module:function"``, resolved in each child.
        timeout_s: most seconds one reward call may take; past it the sample scores 0
            (``"timeout"``) and its child is killed and replaced.
        num_procs: child processes; the samples of a group are scored in parallel across them.

    Raises:
        ValueError: bad arguments, or the children cannot resolve ``reward_fn`` (the child's error,
            e.g. an unknown name or a failed import, is in the message).
        RuntimeError: a child did not start (or restart) within ``START_TIMEOUT_S``.
    """

    def __init__(self, reward_fn: str, *, timeout_s: float = 5.0, num_procs: int = 2) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if num_procs < 1:
            raise ValueError(f"num_procs={num_procs} must be >= 1")
        self.reward_fn = reward_fn
        self.timeout_s = float(timeout_s)
        self._children: list[_Child] = []
        try:
            for _ in range(num_procs):
                self._children.append(self._start_child())
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> IsolatedScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def pids(self) -> list[int]:
        """Process ids of the live children (for tests and logs)."""
        return [c.proc.pid for c in self._children]

    def score(self, completions: Sequence[str], info: dict[str, Any]) -> GroupScore:
        """Rewards of one group; never raises for a failing reward function (see the module docstring)."""
        assert self._children, "score() after close()"
        n = len(completions)
        rewards = [0.0] * n
        errors: list[str | None] = [None] * n
        pending = deque(range(n))
        running: dict[int, tuple[int, float]] = {}  # slot -> (sample index, deadline on time.monotonic())
        while pending or running:
            for slot in range(len(self._children)):
                if slot in running or not pending:
                    continue
                if self._children[slot].proc.poll() is not None:  # died while idle: no sample to blame
                    log.warning("reward child pid %d exited (rc %s) while idle; replacing it",
                                self._children[slot].proc.pid, self._children[slot].proc.returncode)
                    self._replace(slot)
                i = pending.popleft()
                try:
                    _send(self._children[slot].conn, (completions[i], info))
                except OSError:  # died between poll() and send()
                    errors[i] = self._fail(slot, i, "crash")
                    continue
                running[slot] = (i, time.monotonic() + self.timeout_s)
            if not running:
                continue
            next_deadline = min(deadline for _, deadline in running.values())
            wait([self._children[s].conn for s in running], timeout=max(0.0, next_deadline - time.monotonic()))
            now = time.monotonic()
            for slot, (i, deadline) in list(running.items()):
                conn = self._children[slot].conn
                if conn.poll(0):  # a reply or EOF; a reply that beat a late check is still taken
                    del running[slot]
                    try:
                        reply = _recv(conn)
                    except (EOFError, OSError):
                        errors[i] = self._fail(slot, i, "crash")
                        continue
                    if reply[0] == "ok":
                        rewards[i], errors[i] = _finite(reply[1])
                    else:
                        log.warning("reward function raised on sample %d: %s: %.300s; reward set to 0", i, reply[1], reply[2])
                        errors[i] = reply[1]
                elif now >= deadline:
                    del running[slot]
                    errors[i] = self._fail(slot, i, "timeout")
        return GroupScore(rewards, errors)

    def close(self) -> None:
        """Stop every child (asked first, then SIGKILL after ``STOP_TIMEOUT_S``); idempotent."""
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

    def _fail(self, slot: int, index: int, reason: str) -> str:
        """Log a timeout or crash of sample ``index``, replace the child in ``slot``; returns ``reason``."""
        proc = self._children[slot].proc
        if reason == "timeout":
            log.warning("reward function ran past timeout_s=%g on sample %d; killing child pid %d, reward set to 0",
                        self.timeout_s, index, proc.pid)
        else:
            try:  # EOF usually means it died: reap it for the exit code
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass  # alive but closed its socket: killed below all the same
            log.warning("reward child pid %d died (rc %s) on sample %d; reward set to 0", proc.pid, proc.returncode, index)
        self._replace(slot)
        return reason

    def _replace(self, slot: int) -> None:
        """SIGKILL the child in ``slot`` (if still alive) and start a fresh one in its place."""
        old = self._children[slot]
        old.proc.kill()  # no-op on an exited process
        old.proc.wait()
        old.conn.close()
        self._children[slot] = self._start_child()

    def _start_child(self) -> _Child:
        """Start one child and wait for its handshake (it resolved the reward function)."""
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), str(child_sock.fileno()), self.reward_fn],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,  # stdout/stderr: the worker's, so prints and tracebacks land in its log
            )
        finally:
            child_sock.close()
        child = _Child(proc, Connection(parent_sock.detach()))
        try:
            if not child.conn.poll(START_TIMEOUT_S):
                raise RuntimeError(f"reward child pid {proc.pid} did not start within {START_TIMEOUT_S:g} s")
            try:
                kind, detail = _recv(child.conn)
            except (EOFError, OSError):
                raise RuntimeError(f"reward child pid {proc.pid} exited during startup (rc {proc.wait()})") from None
            if kind != "ready":
                raise ValueError(f"reward function {self.reward_fn!r} cannot be loaded: {detail}")
        except BaseException:
            proc.kill()
            proc.wait()
            child.conn.close()
            raise
        return child


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the thread that started it exits (a hung reward call
    ignores anything gentler)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _send(conn: Connection, obj: Any) -> None:
    """Send one JSON message (tuples arrive as lists)."""
    conn.send_bytes(json.dumps(obj).encode())


def _recv(conn: Connection) -> Any:
    """Receive one JSON message; raises EOFError when the other end is gone."""
    return json.loads(conn.recv_bytes())


def child_main(fd: int, reward_fn: str) -> None:
    """A child's loop: resolve ``reward_fn``, handshake, then score one sample per message until
    ``None`` or EOF. Runs in the child only (started by :meth:`IsolatedScorer._start_child`)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the worker decides
    conn = Connection(fd)
    try:
        fn = get_reward_fn(reward_fn)
    except Exception as exc:
        _send(conn, ("error", f"{type(exc).__name__}: {exc}"))
        return
    _send(conn, ("ready", os.getpid()))
    while True:
        try:
            task = _recv(conn)
        except EOFError:
            return
        if task is None:
            return
        completion, info = task
        try:
            reply: tuple = ("ok", float(fn(completion, info)))
        except Exception as exc:  # the process boundary: the parent logs and counts it
            reply = ("error", type(exc).__name__, str(exc)[:MAX_MESSAGE_CHARS])
        _send(conn, reply)
