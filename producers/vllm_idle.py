"""Keep vLLM's engine processes from spinning a core while the producer is idle (docs/ARCHITECTURE.md, "vLLM on
a CPU host").

vLLM's shared-memory queue readers (`shm_broadcast.SpinCondition.wait`) busy-poll for 1 s after every read; a
producer submitting more often than that kept 60-80% of a core busy on the 2-core host. `register()`, a vLLM
general plugin run in every vLLM process, caps that window at `RLBUS_VLLM_BUSY_LOOP_S` seconds (unset: nothing
changes). Since the writer's wake-up PUB drops at a high-water mark of 1 (an idle reader then slept its 5 s
recheck: 5.3 s batches instead of 0.26 s), an idle reader here re-checks every `IDLE_RECHECK_MS`: no message is
lost, none waits longer than that beyond the cap, and an idle reader costs ~1% of a core. Idempotent.
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
    """The cap from `RLBUS_VLLM_BUSY_LOOP_S`, seconds, or None if unset; ValueError: not a finite number >= 0."""
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
    """vLLM general-plugin hook: cap `SpinCondition`'s busy-poll window, if the variable is set and vLLM has it.

    Raises ValueError: a malformed `RLBUS_VLLM_BUSY_LOOP_S`.
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
