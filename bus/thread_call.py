"""A call into another thread's work queue that the caller may give up on without leaving it behind.

The courier's I/O thread owns the sockets; other threads ask it to open one through a queue of
commands (:meth:`bus.courier.Courier.command`). A caller that stops waiting must not leave its
command to run later (a socket opened after the caller was told it failed would leak, bound to
its endpoint). :func:`call_and_wait` settles the race between the caller giving up and the thread
starting the command under one lock: a command still queued is withdrawn (it will return at once
when its turn comes), one already running is abandoned (when it returns, ``undo`` is applied to
its result on the thread that ran it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.05
"""How often a waiting caller checks ``abort``, seconds."""


def call_and_wait(
    post: Callable[..., None],
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float,
    undo: Callable[[Any], None] | None = None,
    abort: Callable[[], bool] = lambda: False,
) -> Any:
    """Run ``fn(*args)`` on the thread that ``post`` feeds and return its result.

    Args:
        post: queues a function for the other thread (``post(run)``).
        timeout_s: longest wait, seconds.
        undo: applied to ``fn``'s result, on the other thread, if ``fn`` was already running when
            the caller gave up (not called if ``fn`` raised).
        abort: checked every :data:`POLL_S`; True gives up at once (e.g. the thread has ended).

    Returns:
        What ``fn`` returned.

    Raises:
        TimeoutError: no answer within ``timeout_s``, or ``abort()`` became true; ``fn`` will not
            run, or its result is undone.
        BaseException: what ``fn`` raised, re-raised in the caller's thread.
    """
    lock, done = threading.Lock(), threading.Event()
    state: dict[str, Any] = {"phase": "queued", "value": None, "error": None}

    def run() -> None:
        with lock:
            if state["phase"] == "withdrawn":
                return
            state["phase"] = "running"
        try:
            value, error = fn(*args), None
        except BaseException as exc:  # handed back to the caller's thread
            value, error = None, exc
        with lock:
            abandoned = state["phase"] == "abandoned"
            state.update(phase="finished", value=value, error=error)
        done.set()
        if abandoned and error is None and undo is not None:
            undo(value)

    post(run)
    deadline = time.monotonic() + timeout_s
    while not done.wait(POLL_S):
        if time.monotonic() < deadline and not abort():
            continue
        with lock:
            phase = state["phase"]
            if phase in ("queued", "running"):  # from now on run() does nothing, or undoes
                state["phase"] = "withdrawn" if phase == "queued" else "abandoned"
        if phase != "finished":
            name = getattr(fn, "__name__", repr(fn))
            raise TimeoutError(f"{name} got no answer within {timeout_s} s; the call was withdrawn")
        break
    if state["error"] is not None:
        raise state["error"]
    return state["value"]
