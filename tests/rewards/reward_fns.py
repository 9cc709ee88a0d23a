"""Reward functions that misbehave on purpose, referenced by import path from the reward tests
(``f"{reward_fns.__name__}:raises"``), so they resolve in the isolated children too."""

from __future__ import annotations

import os
import signal
import time


def length(text: str, info: dict) -> float:
    """Well behaved: the completion's length in characters."""
    return float(len(text))


def sleeps(text: str, info: dict) -> float:
    """Hangs far past any test timeout."""
    time.sleep(60)
    return 1.0


def raises(text: str, info: dict) -> float:
    raise ValueError(f"cannot score {text!r}")


def exits(text: str, info: dict) -> float:
    """Ends its interpreter without cleanup, as a crashing C extension would."""
    os._exit(1)


def segfaults(text: str, info: dict) -> float:
    """Dies of SIGSEGV, as a segfaulting C extension would (sent, not provoked: some sandboxes map page 0)."""
    os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)
    return 1.0


def returns_nan(text: str, info: dict) -> float:
    return float("nan")


def returns_text(text: str, info: dict) -> str:
    return "not a number"  # float() of it raises ValueError


BY_TEXT = {"sleep": sleeps, "raise": raises, "exit": exits, "segv": segfaults, "nan": returns_nan}


def by_text(text: str, info: dict) -> float:
    """Misbehaves as the completion says ("sleep", "raise", "exit", "segv", "nan"); otherwise :func:`length`."""
    return BY_TEXT.get(text, length)(text, info)
