"""Reward isolation: run reward functions in child processes, so a bad one costs a sample, not a worker.

A reward function is user code (a verifier, a sandbox call, a regex over model output). One that
raises, hangs, runs past ``timeout_s``, crashes its interpreter (``os._exit``, a segfault) or returns
NaN must score that sample 0 with the reason counted, and the reward worker must live on.

:class:`IsolatedScorer` keeps a small pool of ``num_procs`` children of its own. Each child is
``python -c <bootstrap>`` started with :mod:`subprocess` (fork+exec, safe from a threaded parent),
talks over one ``socketpair`` framed by :class:`multiprocessing.connection.Connection`, and imports
only this module, the registry and the reward functions it runs (~30 ms to start, ~15 MB, plus
what the functions import: math-verify for ``gsm8k``, ~0.25 s). Not ``multiprocessing``'s "spawn" or
"forkserver" contexts: those re-run the parent's ``__main__`` module (``rewards.proc``: zmq,
numpy, prometheus; ~0.2 s and ~50 MB per child, paid again on every restart) and leave a forkserver
/ resource-tracker process behind; not ``ProcessPoolExecutor``: it cannot kill one stuck worker.

Protocol (parent -> child, child -> parent), one JSON document per message (no pickle):

    child start:  ("ready", pid) | ("error", "'ref': ValueError: unknown reward ...")   # resolve handshake
    per call:     (fn_index, completion, info)  ->  ("ok", float) | ("error", exc_type, message)
    shutdown:     None  (or the parent's end closing: EOF)

Invariants and choices:

* **Several functions, resolved once.** A scorer is given the list of every reward function its
  worker may need (all tasks' functions); each child resolves the whole list at start, and each
  call names the function by its index in that list.
* **Per-call work, each with its own deadline.** :meth:`IsolatedScorer.score` takes a whole
  group and the functions to run on it, hands one (function, sample) call at a time to each idle
  child and waits on all of them together; a call's deadline starts when it is handed to a child
  (not when the group arrives), so only the call that overran is zeroed: the sample keeps the
  scores of its other functions. A group of G samples and K functions therefore takes at most about
  ``ceil(K * G / num_procs) * timeout_s`` even if every call hangs.
* **A child that overruns is SIGKILLed and replaced** before the next call is handed out, so a
  hung function never keeps a slot. A child found dead (EOF on its socket: ``os._exit``, segfault,
  OOM kill) scores its call 0 as ``"crash"`` and is replaced; one found dead while idle is
  replaced without charging any call.
* **Error labels:** the exception type name (``"ValueError"``), ``"timeout"``, ``"crash"``,
  ``"non_finite"``. The scorer returns them per call; :class:`rewards.worker.RewardWorker` counts
  them in ``rlbus_rewards_errors_total{error=...}``.
* **Functions are named, never pickled:** a registry name or an import path
  ``"package.module:function"`` (see :func:`tasks.rewards.get_reward_fn`), resolved inside the
  child. An import path executes code named by the run config, which is trusted; a reference never
  comes from the bus.
* Children ask Linux to SIGKILL them when the thread that started them exits (``PR_SET_PDEATHSIG``),
  so a hung child cannot outlive a reward worker that was killed; a live parent ends them with
  :meth:`IsolatedScorer.close`. A scorer is used from one thread (the worker's main loop).

:class:`InProcessScorer` has the same interface and calls the function directly (no timeout, no
crash protection; exceptions and NaN still score 0): for tests and benchmarks (``rewards.isolate: false``).
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

from tasks.rewards import get_reward_fn

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # child start + import + resolve; generous, a loaded host is slow to exec
STOP_TIMEOUT_S = 2.0  # how long close() lets children exit on their own before SIGKILL
MAX_MESSAGE_CHARS = 300  # of an exception message, as logged

_BOOTSTRAP = (
    "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
    "from rewards.isolation import child_main; child_main(int(sys.argv[2]), json.loads(sys.argv[3]))"
)


@dataclasses.dataclass(frozen=True)
class GroupScore:
    """Scores of one reward function on one group: ``rewards[i]`` (0.0 where ``errors[i]`` is set) and
    ``errors[i]`` (``None`` or the error label of sample i: exception type, ``"timeout"``, ``"crash"``,
    ``"non_finite"``)."""

    rewards: list[float]
    errors: list[str | None]


def _finite(value: float) -> tuple[float, str | None]:
    """``(value, None)`` for a finite reward, ``(0.0, "non_finite")`` for NaN or +-inf."""
    return (value, None) if math.isfinite(value) else (0.0, "non_finite")


def _check_refs(reward_fns: Sequence[str]) -> tuple[str, ...]:
    """The reward references as a tuple; ``TypeError`` for a bare string (it would be read as
    characters), ``ValueError`` for an empty list."""
    if isinstance(reward_fns, str) or not all(isinstance(r, str) for r in reward_fns):
        raise TypeError(f"reward_fns must be a list of reward references (str), got {reward_fns!r}")
    if not reward_fns:
        raise ValueError("reward_fns is empty: give at least one reward function")
    return tuple(reward_fns)


def _fn_indices(fns: Sequence[int] | None, num_fns: int) -> list[int]:
    """``fns`` checked against ``num_fns`` (``None``: all of them)."""
    indices = list(range(num_fns)) if fns is None else list(fns)
    bad = [k for k in indices if not 0 <= k < num_fns]
    if bad:
        raise ValueError(f"reward function indices {bad} out of range: this scorer has {num_fns}")
    return indices


class InProcessScorer:
    """Calls the reward functions in this process: exceptions and NaN score 0, hangs and crashes don't
    (no isolation). Same interface as :class:`IsolatedScorer`.

    Raises:
        TypeError, ValueError: ``reward_fns`` is a string or empty, or names an unknown reward or
            import path.
    """

    def __init__(self, reward_fns: Sequence[str]) -> None:
        self.reward_fns = _check_refs(reward_fns)
        self._fns = [get_reward_fn(ref) for ref in self.reward_fns]

    def score(self, completions: Sequence[str], info: dict[str, Any], fns: Sequence[int] | None = None) -> list[GroupScore]:
        """One :class:`GroupScore` per index in ``fns`` (default: every function), in that order."""
        out = []
        for k in _fn_indices(fns, len(self._fns)):
            rewards: list[float] = []
            errors: list[str | None] = []
            for i, text in enumerate(completions):
                try:
                    reward, error = _finite(float(self._fns[k](text, info)))
                except Exception as exc:
                    log.warning("reward function %s raised on sample %d: %s: %.300s; reward set to 0",
                                self.reward_fns[k], i, type(exc).__name__, exc)
                    reward, error = 0.0, type(exc).__name__
                rewards.append(reward)
                errors.append(error)
            out.append(GroupScore(rewards, errors))
        return out

    def close(self) -> None:
        """Nothing to release."""


@dataclasses.dataclass
class _Child:
    proc: subprocess.Popen
    conn: Connection


class IsolatedScorer:
    """Scores groups with reward functions that run in ``num_procs`` child processes.

    Args:
        reward_fns: registry names or ``"package.module:function"`` paths, every one resolved in
            each child at its start; :meth:`score` names them by index.
        timeout_s: most seconds one reward call may take; past it that call scores 0
            (``"timeout"``) and its child is killed and replaced.
        num_procs: child processes; the calls of a group are made in parallel across them.

    Raises:
        TypeError: ``reward_fns`` is a string, not a list.
        ValueError: bad arguments, or the children cannot resolve one of ``reward_fns`` (the
            child's error, e.g. an unknown name or a failed import, is in the message).
        RuntimeError: a child did not start (or restart) within ``START_TIMEOUT_S``.
    """

    def __init__(self, reward_fns: Sequence[str], *, timeout_s: float = 5.0, num_procs: int = 2) -> None:
        self.reward_fns = _check_refs(reward_fns)
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if num_procs < 1:
            raise ValueError(f"num_procs={num_procs} must be >= 1")
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

    def score(self, completions: Sequence[str], info: dict[str, Any], fns: Sequence[int] | None = None) -> list[GroupScore]:
        """Scores of one group: one :class:`GroupScore` per index in ``fns`` (default: every
        function), in that order. Never raises for a failing reward function (see the module
        docstring).

        Raises:
            ValueError: an index in ``fns`` is out of range.
        """
        assert self._children, "score() after close()"
        indices = _fn_indices(fns, len(self.reward_fns))
        n = len(completions)
        rewards = [[0.0] * n for _ in indices]
        errors: list[list[str | None]] = [[None] * n for _ in indices]
        pending = deque((j, i) for j in range(len(indices)) for i in range(n))  # (position in fns, sample)
        running: dict[int, tuple[int, int, float]] = {}  # slot -> (position in fns, sample, deadline on time.monotonic())
        while pending or running:
            for slot in range(len(self._children)):
                if slot in running or not pending:
                    continue
                if self._children[slot].proc.poll() is not None:  # died while idle: no call to blame
                    log.warning("reward child pid %d exited (rc %s) while idle; replacing it",
                                self._children[slot].proc.pid, self._children[slot].proc.returncode)
                    self._replace(slot)
                j, i = pending.popleft()
                try:
                    _send(self._children[slot].conn, (indices[j], completions[i], info))
                except OSError:  # died between poll() and send()
                    errors[j][i] = self._fail(slot, indices[j], i, "crash")
                    continue
                running[slot] = (j, i, time.monotonic() + self.timeout_s)
            if not running:
                continue
            next_deadline = min(deadline for _, _, deadline in running.values())
            wait([self._children[s].conn for s in running], timeout=max(0.0, next_deadline - time.monotonic()))
            now = time.monotonic()
            for slot, (j, i, deadline) in list(running.items()):
                conn = self._children[slot].conn
                if conn.poll(0):  # a reply or EOF; a reply that beat a late check is still taken
                    del running[slot]
                    try:
                        reply = _recv(conn)
                    except (EOFError, OSError):
                        errors[j][i] = self._fail(slot, indices[j], i, "crash")
                        continue
                    if reply[0] == "ok":
                        rewards[j][i], errors[j][i] = _finite(reply[1])
                    else:
                        log.warning("reward function %s raised on sample %d: %s: %.300s; reward set to 0",
                                    self.reward_fns[indices[j]], i, reply[1], reply[2])
                        errors[j][i] = reply[1]
                elif now >= deadline:
                    del running[slot]
                    errors[j][i] = self._fail(slot, indices[j], i, "timeout")
        return [GroupScore(r, e) for r, e in zip(rewards, errors)]

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

    def _fail(self, slot: int, fn: int, index: int, reason: str) -> str:
        """Log a timeout or crash of function ``fn`` on sample ``index``, replace the child in ``slot``;
        returns ``reason``."""
        proc = self._children[slot].proc
        if reason == "timeout":
            log.warning("reward function %s ran past timeout_s=%g on sample %d; killing child pid %d, reward set to 0",
                        self.reward_fns[fn], self.timeout_s, index, proc.pid)
        else:
            try:  # EOF usually means it died: reap it for the exit code
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass  # alive but closed its socket: killed below all the same
            log.warning("reward child pid %d died (rc %s) in %s on sample %d; reward set to 0",
                        proc.pid, proc.returncode, self.reward_fns[fn], index)
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
        """Start one child and wait for its handshake (it resolved every reward function)."""
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, json.dumps(sys.path), str(child_sock.fileno()), json.dumps(self.reward_fns)],
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
                raise ValueError(f"reward function {detail}")
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


def child_main(fd: int, reward_fns: list[str]) -> None:
    """A child's loop: resolve every one of ``reward_fns``, handshake, then make one call per
    message ``(fn_index, completion, info)`` until ``None`` or EOF. Runs in the child only (started
    by :meth:`IsolatedScorer._start_child`)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the worker decides
    conn = Connection(fd)
    fns = []
    for ref in reward_fns:
        try:
            fns.append(get_reward_fn(ref))
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
        k, completion, info = request
        try:
            reply: tuple = ("ok", float(fns[k](completion, info)))
        except Exception as exc:  # the process boundary: the parent logs and counts it
            reply = ("error", type(exc).__name__, str(exc)[:MAX_MESSAGE_CHARS])
        _send(conn, reply)
