"""Fixtures of the observability tests: the ``prometheus`` executable (installed when missing)."""

from __future__ import annotations

import pytest

from tests.observability.prometheus_server import prometheus_binary


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    """Path of a real ``prometheus`` binary; skips (with the reason) where none can be had."""
    return prometheus_binary()
