"""Prometheus metrics shared by every component (bus traffic, stage accounting) and the HTTP endpoint that
serves a process's registry: ``/metrics`` and ``/health``. Names: ``rlbus_`` prefix, component, base units,
``_total`` for counters; labelled series are created at 0 so they exist from the first scrape.
:class:`StageMeter`: ``rate(rlbus_stage_busy_seconds_total[1m])`` is a stage's utilisation (docs/metrics.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

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
BUS_DUPLICATES = Counter(
    "rlbus_bus_duplicates_total", "Data messages received again and dropped by id, per topic", ["topic"]
)
BUS_PEER_DEATHS = Counter(
    "rlbus_bus_peer_deaths_total",
    "Peers of a data topic declared dead or gone, per topic and reason",
    ["topic", "reason"],
)
BUS_QUEUED = Gauge(
    "rlbus_bus_queued_messages",
    "Data messages waiting: inbox (received, not yet taken by the component), outbox_not_taken, "
    "outbox_unfinished (not done downstream)",
    ["topic", "queue"],
)
BUS_QUEUED_BYTES = Gauge(
    "rlbus_bus_queued_bytes",
    "Bytes of the data messages counted in rlbus_bus_queued_messages (message frames), per topic and queue",
    ["topic", "queue"],
)
BUS_COURIER_ERRORS = Counter(
    "rlbus_bus_courier_errors_total",
    "Exceptions in a courier's I/O loop (each logged with its traceback); "
    "bus.courier.MAX_LOOP_ERRORS in a row fail the courier and its component",
)
POLICY_VERSION = Gauge("rlbus_policy_version", "Policy version this component last saw or uses")
METRICS_TLS_REFUSED = Counter(
    "rlbus_bus_metrics_tls_refused_total",
    "Connections to this process's TLS metrics endpoint dropped in the handshake "
    "(no or unknown client certificate, not TLS, timeout)",
)

# every reason label of the reject, peer-death and redelivery counters (a test checks the code uses no other)
REJECT_REASONS = (
    "header",
    "schema",
    "dtype",
    "shape",
    "size",
    "frames",
    "field",
    "unknown_type",
    "inconsistent",  # wire/messages
    "envelope",
    "too_large",
    "decode",
    "unexpected_type",
    "id_mismatch",
    "wrong_direction",
    "foreign_ack",  # sockets
    "checksum",  # a weights bucket whose crc32 does not match its bytes (broadcaster.bus_fetch)
)
PEER_LOSS_REASONS = ("silent", "unreachable", "goodbye", "restarted")
REDELIVER_REASONS = (*PEER_LOSS_REASONS, "ack_timeout")
QUEUES = {"recv": ("inbox",), "send": ("outbox_not_taken", "outbox_unfinished")}  # queue labels per side


def declare_topic(topic: str, direction: str, *, reliable: bool) -> None:
    """Create at 0 every series one side (``direction``) of ``topic`` can update, so rates see it from the
    first scrape; ``reliable``: a data topic (queues, redeliveries, duplicates, peer deaths too)."""
    BUS_MESSAGES.labels(topic, direction)
    BUS_BYTES.labels(topic, direction)
    for reason in REJECT_REASONS:
        BUS_REJECTED.labels(topic, reason)
    if direction == "send":
        BUS_BLOCKED_SECONDS.labels(topic)
    if not reliable:
        return
    for queue in QUEUES[direction]:
        BUS_QUEUED.labels(topic, queue)
        BUS_QUEUED_BYTES.labels(topic, queue)
    for reason in PEER_LOSS_REASONS:
        BUS_PEER_DEATHS.labels(topic, reason)
    if direction == "send":
        for reason in REDELIVER_REASONS:
            BUS_REDELIVERED.labels(topic, reason)
    else:
        BUS_DUPLICATES.labels(topic)


STAGES = ("producer", "rewards", "packer", "trainer")  # in data-flow order
STAGE_SAMPLES = Counter(
    "rlbus_stage_samples_total", "Samples a stage finished (generated, scored, packed, trained)", ["stage"]
)
STAGE_TOKENS = Counter(
    "rlbus_stage_tokens_total", "Completion tokens of the samples a stage finished, tokens", ["stage"]
)
STAGE_LATENCY = Histogram(
    "rlbus_stage_latency_seconds",
    "Time a stage spent on one item (producer, rewards, packer: a group; trainer: an optimizer step), seconds",
    ["stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)


class StageMeter:
    """Busy/idle seconds, throughput and latency of one stage in this process: busy while at least one
    item is in :meth:`work` (items may overlap), exported at scrape time, so a long item shows while it runs.

    Raises:
        ValueError: ``stage`` is not a known stage.
    """

    def __init__(self, stage: str) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")
        self.stage = stage
        self._lock = threading.Lock()
        self._active = 0
        self._since = time.monotonic()
        self._busy_s = 0.0
        self._idle_s = 0.0
        self._samples = STAGE_SAMPLES.labels(stage)
        self._tokens = STAGE_TOKENS.labels(stage)
        self._latency = STAGE_LATENCY.labels(stage)
        _STAGE_TIMES.meters.add(self)

    def _flip(self, delta: int) -> None:
        now = time.monotonic()
        with self._lock:
            if (self._active == 0) != (self._active + delta == 0):  # busy <-> idle
                elapsed = now - self._since
                if self._active == 0:
                    self._idle_s += elapsed
                else:
                    self._busy_s += elapsed
                self._since = now
            self._active += delta

    def seconds(self) -> tuple[float, float]:
        """``(busy, idle)`` seconds since the meter was created, up to now."""
        with self._lock:
            elapsed = time.monotonic() - self._since
            busy, idle = self._busy_s, self._idle_s
            if self._active:
                busy += elapsed
            else:
                idle += elapsed
        return busy, idle

    @contextlib.contextmanager
    def work(self) -> Iterator[None]:
        """Count the ``with`` block as busy time and observe its duration as one item's latency."""
        started = time.perf_counter()
        self._flip(+1)
        try:
            yield
        finally:
            self._flip(-1)
            self._latency.observe(time.perf_counter() - started)

    def finished(self, samples: int, tokens: int) -> None:
        """Count ``samples`` finished samples holding ``tokens`` completion tokens."""
        self._samples.inc(samples)
        self._tokens.inc(tokens)


class _StageTimes(Collector):
    """Exports the busy and idle seconds of every live :class:`StageMeter`, per stage."""

    def __init__(self) -> None:
        self.meters: weakref.WeakSet[StageMeter] = weakref.WeakSet()

    def collect(self):
        totals = {stage: [0.0, 0.0] for stage in {m.stage for m in list(self.meters)}}
        for meter in list(self.meters):
            busy, idle = meter.seconds()
            totals[meter.stage][0] += busy
            totals[meter.stage][1] += idle
        for k, (name, doc) in enumerate((("busy", "with at least one item in work"), ("idle", "waiting for work"))):
            family = CounterMetricFamily(
                f"rlbus_stage_{name}_seconds", f"Seconds a stage spent {doc}", labels=["stage"]
            )
            for stage, pair in sorted(totals.items()):
                family.add_metric([stage], pair[k])
            yield family

    def describe(self):
        for name in ("busy", "idle"):
            yield CounterMetricFamily(f"rlbus_stage_{name}_seconds", "", labels=["stage"])


_STAGE_TIMES = _StageTimes()
REGISTRY.register(_STAGE_TIMES)


HealthFn = Callable[[], tuple[bool, dict]]  # (healthy, body): 200 with body as JSON, else 503


def _handler(registry, health: HealthFn | None) -> type[BaseHTTPRequestHandler]:
    started = time.time()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path == "/health":
                healthy, body = health() if health is not None else (True, {})
                body = {
                    "status": "ok" if healthy else "unhealthy",
                    "pid": os.getpid(),
                    "uptime_s": round(time.time() - started, 3),
                    **body,
                }
                self._reply(200 if healthy else 503, "application/json", json.dumps(body).encode())
            else:
                self._reply(404, "text/plain; charset=utf-8", b"not found: try /metrics or /health\n")

        def _reply(self, code: int, content_type: str, payload: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *_args) -> None:  # scrapes every few seconds: keep the logs quiet
            pass

    return Handler


TLS_HANDSHAKE_TIMEOUT_S = 5.0  # longest TLS handshake (and each read) of a client, seconds


class _TlsServer(ThreadingHTTPServer):
    """Runs the TLS handshake in each request's thread (a stalled client never blocks ``accept``); a
    failed handshake is dropped and counted, not logged."""

    tls: ssl.SSLContext

    def finish_request(self, request, client_address) -> None:
        request.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            METRICS_TLS_REFUSED.inc()
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


def start_metrics_server(
    port: int,
    host: str = "127.0.0.1",
    *,
    health: HealthFn | None = None,
    registry=REGISTRY,
    tls: ssl.SSLContext | None = None,
) -> ThreadingHTTPServer:
    """Serve ``/metrics`` and ``/health`` (JSON ``status``, ``pid``, ``uptime_s`` and ``health()``'s fields;
    503 unless healthy) on ``host:port`` (0: a free port) from a daemon thread; with ``tls`` HTTPS only.
    Stop it with ``shutdown()`` + ``server_close()``.

    Raises:
        OSError: the port is taken.
    """
    if tls is None:
        server = ThreadingHTTPServer((host, port), _handler(registry, health))
    else:
        server = _TlsServer((host, port), _handler(registry, health))
        server.tls = tls
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server


def serve_metrics(
    port: int,
    host: str = "127.0.0.1",
    *,
    health: HealthFn | None = None,
    registry=REGISTRY,
    tls: ssl.SSLContext | None = None,
) -> int:
    """:func:`start_metrics_server` for a process that serves until it exits; returns the port bound.

    Raises:
        OSError: the port is taken.
    """
    return int(start_metrics_server(port, host, health=health, registry=registry, tls=tls).server_address[1])
