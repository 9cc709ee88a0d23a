"""Prometheus metrics shared by every component: bus traffic counters and the HTTP endpoint.

Each component process serves the default prometheus-client registry on its own port
(``/metrics``). Names follow Prometheus conventions: ``rlbus_`` prefix, base units, ``_total``
for counters.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, start_http_server

BUS_MESSAGES = Counter(
    "rlbus_bus_messages_total", "Messages sent or received, per topic and direction", ["topic", "direction"]
)
BUS_BYTES = Counter(
    "rlbus_bus_bytes_total", "Bytes sent or received (all frames), per topic and direction", ["topic", "direction"]
)
BUS_REJECTED = Counter(
    "rlbus_bus_rejected_total", "Received messages dropped as malformed, per topic and reason", ["topic", "reason"]
)
BUS_BLOCKED_SECONDS = Counter(
    "rlbus_bus_blocked_seconds_total", "Seconds a sender waited at the high-water mark, per topic", ["topic"]
)
BUS_REDELIVERED = Counter(
    "rlbus_bus_redelivered_total",
    "Data messages re-sent, per topic and reason (silent / unreachable / goodbye / restarted peer, ack_timeout)",
    ["topic", "reason"],
)
BUS_DUPLICATES = Counter("rlbus_bus_duplicates_total", "Data messages received again and dropped by id, per topic", ["topic"])
BUS_PEER_DEATHS = Counter(
    "rlbus_bus_peer_deaths_total", "Peers of a data topic declared dead or gone, per topic and reason", ["topic", "reason"]
)
BUS_QUEUED = Gauge(
    "rlbus_bus_queued_messages",
    "Data messages waiting: inbox (received, not yet taken by the component), outbox_not_taken, outbox_unfinished (not done downstream)",
    ["topic", "queue"],
)
POLICY_VERSION = Gauge("rlbus_policy_version", "Policy version this component last saw or uses")


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` of the default registry on ``host:port`` in a daemon thread.

    Args:
        port: TCP port; 0 picks a free one.

    Returns:
        The port actually bound.

    Raises:
        OSError: the port is taken.
    """
    server, _thread = start_http_server(port, addr=host)
    return int(server.server_address[1])
