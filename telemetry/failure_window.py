"""Failure shares of user functions (reward functions, environments, agents) over their recent calls.

A component records each call's outcome per function; :meth:`FailureWindows.report` is what its heartbeats
carry to ``busctl up`` (:class:`bus.messages.ComponentHeartbeat` ``failures``), which prints the warning and
stops the run (docs/ARCHITECTURE.md, "Failure containment"). A function may warn once a quarter of its window is
filled, and stop the run only once the window is full, so a few early failures never stop a run; the level goes
back to ``ok`` once the share falls to half the warning share, so a term warns again only after a real recovery.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Sequence

log = logging.getLogger(__name__)

LEVELS = ("ok", "warn", "stop")
MAX_MESSAGE_CHARS = 300
MAX_FUNCTIONS = 64  # reported per component (a config names a few; the bound keeps heartbeats small)

Outcome = tuple[str, str] | None  # None: the call succeeded; else (error label, first line of its message)


@dataclasses.dataclass
class _Window:
    kind: str
    recent: deque
    calls: int = 0
    errors: int = 0
    error: str = ""
    message: str = ""
    level: str = "ok"


class FailureWindows:
    """Per function: calls, failures, the first failure's label and message, and the failure share of the last
    ``window`` calls; ``warn_fraction`` < ``max_fraction`` (shares in [0, 1]; a share above ``max_fraction`` is
    level ``stop``). Thread-safe: the heartbeat thread reads :meth:`report`. ValueError for bad arguments."""

    def __init__(self, *, window: int, warn_fraction: float, max_fraction: float) -> None:
        if window < 1 or not 0 <= warn_fraction <= max_fraction <= 1:
            raise ValueError(
                f"need window >= 1 and 0 <= warn_fraction <= max_fraction <= 1, got {window}, "
                f"{warn_fraction}, {max_fraction}"
            )
        self.window, self.warn_fraction, self.max_fraction = window, warn_fraction, max_fraction
        self._by_name: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def record(self, kind: str, name: str, outcomes: Sequence[Outcome]) -> str:
        """Add the outcomes of ``name``'s calls (``kind``: ``reward``, ``env`` or ``agent``), in call order;
        returns the function's level after them (:data:`LEVELS`)."""
        with self._lock:
            w = self._by_name.get(name)
            if w is None:
                if len(self._by_name) >= MAX_FUNCTIONS:
                    return "ok"
                w = self._by_name[name] = _Window(kind, deque(maxlen=self.window))
            for outcome in outcomes:
                w.calls += 1
                w.recent.append(outcome is not None)
                if outcome is not None:
                    w.errors += 1
                    if not w.error:
                        w.error, w.message = outcome[0], _first_line(outcome[1])
            before, w.level = w.level, self._level(w)
        if w.level != before:
            log.warning(
                "%s %s now %s: fails on %.0f%% of its last %d calls (%d of %d calls so far; first: %s: %s)",
                kind,
                name,
                w.level,
                100 * _share(w),
                len(w.recent),
                w.errors,
                w.calls,
                w.error,
                w.message,
            )
        return w.level

    def _level(self, w: _Window) -> str:
        """``stop`` is final; ``warn`` holds until the share falls to half the warning share."""
        if len(w.recent) < max(1, self.window // 4) or w.level == "stop":
            return w.level
        share = _share(w)
        if share > self.max_fraction and len(w.recent) == self.window:
            return "stop"
        if share > self.warn_fraction:
            return "warn"
        return "ok" if share <= self.warn_fraction / 2 else w.level

    def report(self) -> dict[str, dict]:
        """``{name: {kind, calls, errors, share, error, message, level}}`` of every function with a failure so
        far (``share``: of the last ``window`` calls, or of the calls so far while fewer)."""
        with self._lock:
            return {
                name: {
                    "kind": w.kind,
                    "calls": w.calls,
                    "errors": w.errors,
                    "share": round(_share(w), 4),
                    "window": len(w.recent),
                    "error": w.error,
                    "message": w.message,
                    "level": w.level,
                }
                for name, w in self._by_name.items()
                if w.errors
            }


def _share(w: _Window) -> float:
    return sum(w.recent) / len(w.recent) if w.recent else 0.0


def _first_line(message: str) -> str:
    line = next((s for s in str(message).splitlines() if s.strip()), "")
    return line.strip()[:MAX_MESSAGE_CHARS]


def outcomes(errors: Sequence[str | None], message: str) -> list[Outcome]:
    """Outcomes from per-call error labels (None: success) sharing one ``message``."""
    return [None if e is None else (e, message or e) for e in errors]
