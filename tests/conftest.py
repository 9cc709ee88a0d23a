"""Fixtures shared by every test package (``tests/bus``, ``tests/busctl``, ...).

``metric(name, **labels)`` reads the current value of a sample from this test process's default
Prometheus registry (0 if never set).
"""

from __future__ import annotations

from typing import Callable

import pytest
from prometheus_client import REGISTRY


def sample(name: str, **labels: str) -> float:
    """Current value of a sample in the default Prometheus registry (0 if never set)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def metric() -> Callable[..., float]:
    """:func:`sample`, as a fixture."""
    return sample
