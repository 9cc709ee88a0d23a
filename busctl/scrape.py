"""Read components' Prometheus metrics over HTTP(S) and turn two readings into rates.

The supervisor's :class:`MetricsPoller` scrapes every ready component's ``/metrics`` on its own daemon thread (a
slow or dead component never delays healing) and keeps what ``status.json``, ``busctl status`` and the live
display show: throughput (rates of ``rlbus_stage_{samples,tokens}_total`` over :data:`RATE_WINDOW_S`, like
Prometheus' ``rate(x[20s])``: stages finish work in bursts, so a rate between two scrapes would flicker), the
busy fraction and the queue depths. Counter resets (a restarted component) count from zero, as ``rate()`` does;
a value that cannot be computed yet is ``None``, never a made-up zero.
"""

from __future__ import annotations

import ssl
import threading
from collections import deque
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client.parser import text_string_to_metric_families

POLL_INTERVAL_S = 2.0
"""Seconds between two scrapes of the same component."""

SCRAPE_TIMEOUT_S = 1.0
"""Longest one scrape may take (connect + read), seconds; a slower component is skipped this round."""

RATE_WINDOW_S = 20.0
"""Rates and the busy fraction are measured over (about) this many recent seconds."""

STAGE_SAMPLES, STAGE_TOKENS = "rlbus_stage_samples_total", "rlbus_stage_tokens_total"
STAGE_BUSY, STAGE_IDLE = "rlbus_stage_busy_seconds_total", "rlbus_stage_idle_seconds_total"
QUEUED = "rlbus_bus_queued_messages"
ENDPOINT_PORT = "rlbus_producer_endpoint_port"


@dataclass(frozen=True)
class Scrape:
    """One reading of a component's ``/metrics``: ``at`` (``time.monotonic()``, seconds) and sample name
    (``"x_total"``, ``"h_bucket"``) -> list of (labels, value)."""

    at: float
    samples: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)

    def total(self, name: str, **labels: str) -> float | None:
        """Sum of the samples called ``name`` whose labels include ``labels``; None when there is no such sample."""
        rows = self.samples.get(name)
        if rows is None:
            return None
        return sum(v for got, v in rows if all(got.get(k) == want for k, want in labels.items()))


def parse_metrics(text: str, at: float) -> Scrape:
    """Parse Prometheus text exposition (``/metrics``) taken at monotonic time ``at``.

    Raises:
        ValueError: the text is not valid exposition format.
    """
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return Scrape(at, samples)


def metrics_url(port: int, host: str = "127.0.0.1", tls: ssl.SSLContext | None = None, path: str = "/metrics") -> str:
    """``http://HOST:PORT/metrics``, or ``https://`` with ``tls``."""
    return f"{'https' if tls is not None else 'http'}://{host}:{port}{path}"


def fetch_metrics(
    port: int, host: str = "127.0.0.1", timeout_s: float = SCRAPE_TIMEOUT_S, tls: ssl.SSLContext | None = None
) -> bytes:
    """The body of ``/metrics`` at ``host:port`` (HTTPS with the client context ``tls``).

    Raises:
        OSError: connection refused, timeout, HTTP error, TLS refused (``ssl.SSLError``, ``URLError``).
    """
    with urllib.request.urlopen(metrics_url(port, host, tls), timeout=timeout_s, context=tls) as resp:
        return resp.read()


def scrape(
    port: int, host: str = "127.0.0.1", timeout_s: float = SCRAPE_TIMEOUT_S, tls: ssl.SSLContext | None = None
) -> Scrape:
    """GET and parse ``/metrics`` at ``host:port`` (HTTPS presenting the client certificate of ``tls``).

    Raises:
        OSError: as :func:`fetch_metrics`. ValueError: unparsable body.
    """
    body = fetch_metrics(port, host, timeout_s, tls).decode("utf-8")
    return parse_metrics(body, time.monotonic())


def counter_delta(prev: float, cur: float) -> float:
    """Increase of a counter between two readings; a lower reading restarted from 0 (``rate()`` semantics)."""
    return cur if cur < prev else cur - prev


def counter_rate(prev: Scrape, cur: Scrape, name: str) -> float | None:
    """Per-second increase of counter ``name`` (its series summed) from ``prev`` to ``cur``, 1/s; None if ``cur``
    does not expose it or no time passed."""
    now, dt = cur.total(name), cur.at - prev.at
    if now is None or dt <= 0:
        return None
    return counter_delta(prev.total(name) or 0.0, now) / dt


def busy_fraction(prev: Scrape, cur: Scrape) -> float | None:
    """``d busy / (d busy + d idle)`` of the stage seconds counters, in [0, 1]; None without counters or growth."""
    values = [(prev.total(n), cur.total(n)) for n in (STAGE_BUSY, STAGE_IDLE)]
    if any(c is None for _, c in values):
        return None
    busy, idle = (counter_delta(p or 0.0, c) for p, c in values)
    return busy / (busy + idle) if busy + idle > 0 else None


def queue_depths(cur: Scrape) -> dict[str, float]:
    """``{"topic/queue": messages}`` of ``rlbus_bus_queued_messages``."""
    return {f"{lab.get('topic', '?')}/{lab.get('queue', '?')}": v for lab, v in cur.samples.get(QUEUED, [])}


def component_stats(prev: Scrape | None, cur: Scrape) -> dict:
    """What ``status.json`` records of one component from its last two scrapes.

    Returns:
        ``{"throughput": {"samples_per_s": x, "tokens_per_s": y}, "busy": f, "queue_depth": n, "queues": {...}}``,
        plus ``"endpoint_port"`` for a producer serving its OpenAI-compatible endpoint; rates and ``busy`` are None
        without ``prev``.
    """
    queues = queue_depths(cur)
    samples = tokens = busy = None
    if prev is not None:
        samples = counter_rate(prev, cur, STAGE_SAMPLES)
        tokens = counter_rate(prev, cur, STAGE_TOKENS)
        busy = busy_fraction(prev, cur)
    stats = {
        "throughput": {"samples_per_s": samples, "tokens_per_s": tokens},
        "busy": busy,
        "queue_depth": sum(queues.values()) if queues else None,
        "queues": queues,
    }
    endpoint_port = cur.total(ENDPOINT_PORT)
    if endpoint_port:  # a producer serving the OpenAI-compatible endpoint (producers.endpoint)
        stats["endpoint_port"] = int(endpoint_port)
    return stats


class MetricsPoller:
    """Scrapes components' metrics on a daemon thread and keeps their latest stats.

    Args:
        targets: called once per round from the poller's thread, read only: ``[(name, host, port), ...]``.
        window_s: rates are over the scrapes of the last ``max(window_s, interval_s)`` seconds.

    Attributes:
        stats: component name -> :func:`component_stats`, replaced whole after every round (one consistent round
            for a reader on another thread). failures: component name -> the latest scrape error.
    """

    def __init__(
        self,
        targets: Callable[[], list[tuple[str, str, int]]],
        interval_s: float = POLL_INTERVAL_S,
        timeout_s: float = SCRAPE_TIMEOUT_S,
        window_s: float = RATE_WINDOW_S,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.targets = targets
        self.tls = tls
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.stats: dict[str, dict] = {}
        self.failures: dict[str, str] = {}
        self.window_s = max(window_s, interval_s)
        self._history: dict[str, tuple[tuple[str, int], deque[Scrape]]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> dict[str, dict]:
        """Scrape every target once; update and return :attr:`stats`. A failing target keeps its previous stats; one
        at a new address (a restarted component) starts a new history."""
        stats, failures, seen = {}, {}, set()
        for name, host, port in self.targets():
            seen.add(name)
            try:
                cur = scrape(port, host, self.timeout_s, self.tls)
            except (OSError, ValueError) as err:
                failures[name] = str(err)
                if name in self.stats:
                    stats[name] = self.stats[name]
                continue
            prev_address, history = self._history.get(name, ((host, port), deque()))
            if prev_address != (host, port):
                history = deque()
            while len(history) > 1 and cur.at - history[1].at >= self.window_s:
                history.popleft()  # keep the newest reading at least a window old as the base
            stats[name] = component_stats(history[0] if history else None, cur)
            history.append(cur)
            self._history[name] = ((host, port), history)
        self._history = {n: v for n, v in self._history.items() if n in seen}
        self.stats, self.failures = stats, failures
        return stats

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        """Start the polling thread (a daemon: it never keeps the process alive)."""
        self._thread = threading.Thread(target=self._loop, name="metrics-poller", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (waits for the round in progress, bounded by the scrape timeouts)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s * 20 + self.interval_s)
            self._thread = None
