"""A call into another thread's work queue that the caller may give up on without leaving it behind (a
socket opened after its caller was told it failed would leak). :func:`call_and_wait` settles, under one lock,
the race between the caller giving up and the thread starting the call: a queued call is withdrawn, a
running one is abandoned and ``undo`` applied to its result on the thread that ran it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.05  # how often a waiting caller checks abort, seconds


def call_and_wait(
    post: Callable[..., None],
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float,
    undo: Callable[[Any], None] | None = None,
    abort: Callable[[], bool] = lambda: False,
) -> Any:
    """Run ``fn(*args)`` on the thread that ``post`` feeds and return its result; ``undo`` is applied to the
    result of a call that was running when the caller gave up; ``abort`` (checked every :data:`POLL_S`) gives up.

    Raises:
        TimeoutError: no answer within ``timeout_s`` seconds, or ``abort()`` (the call is withdrawn).
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
