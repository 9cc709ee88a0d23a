"""Waiting in tests for something that must happen, without fixed sleeps."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest


def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float) -> Any:
    """Poll ``predicate`` every 10 ms until it is truthy (returns its value); fail naming ``what``
    after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() >= deadline:
            pytest.fail(f"{what}: not within {timeout_s} s")
        time.sleep(0.01)
    return value
