"""Where busctl reads metrics: every component at the address it reported (pure functions).

A component serves ``/metrics`` on 127.0.0.1 in a local run and on its node's address under Slurm or Ray; its
ready handshake says which (``ComponentSpec.metrics_host``). Every reader takes the address from there, never a
fixed host: ``prometheus.yml``, the metrics poller and the end-of-run snapshot.
"""

from __future__ import annotations

from typing import Iterable

from busctl.components.table import LIVE_STATES, ComponentSpec
from configs.schema import RunConfig

LOOPBACK = "127.0.0.1"
"""Where a local run serves metrics (reachable from this host only)."""


def supervisor_metrics_host(cfg: RunConfig) -> str:
    """The address busctl serves its own metrics on: ``bus.hosts["supervisor"]`` on tcp, else :data:`LOOPBACK`."""
    host = cfg.bus.hosts.get("supervisor", "") if cfg.bus.transport == "tcp" else ""
    return host or LOOPBACK


def served_targets(table: Iterable[ComponentSpec]) -> list[tuple[str, str, int]]:
    """``(name, host, port)`` of every component that reported a metrics port (any state)."""
    return [(s.name, s.metrics_host or LOOPBACK, s.metrics_port) for s in list(table) if s.metrics_port]


def live_targets(table: Iterable[ComponentSpec]) -> list[tuple[str, str, int]]:
    """``(name, host, port)`` of every ready (live) component: what the metrics poller scrapes."""
    return served_targets(s for s in list(table) if s.state in LIVE_STATES)


def prometheus_targets(table: Iterable[ComponentSpec], supervisor: tuple[str, int]) -> list[tuple[str, str, str, int]]:
    """``(component, role, host, port)`` per component with a metrics port, then busctl's own: the targets of
    ``prometheus.yml``."""
    rows = [(s.name, s.role, s.metrics_host or LOOPBACK, s.metrics_port) for s in list(table) if s.metrics_port]
    return [*rows, ("supervisor", "supervisor", *supervisor)]
