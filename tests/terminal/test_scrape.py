"""``busctl.scrape`` against real Prometheus endpoints: prometheus-client HTTP servers started by the
test, each with its own registry of real counters and gauges named as the components' are."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from busctl.components.table import free_port
from busctl.scrape import MetricsPoller, component_stats, counter_delta, parse_metrics, scrape
from tests.waiting import wait_until


class Endpoint:
    """One process's worth of rlbus metrics, served over HTTP on a free port."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.samples = Counter("rlbus_stage_samples_total", "samples", ["stage"], registry=r)
        self.tokens = Counter("rlbus_stage_tokens_total", "tokens", ["stage"], registry=r)
        self.busy = Counter("rlbus_stage_busy_seconds_total", "busy", ["stage"], registry=r)
        self.idle = Counter("rlbus_stage_idle_seconds_total", "idle", ["stage"], registry=r)
        self.queued = Gauge("rlbus_bus_queued_messages", "queued", ["topic", "queue"], registry=r)
        self.server, _thread = start_http_server(0, addr="127.0.0.1", registry=r)
        self.port = int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoints():
    made: list[Endpoint] = []

    def make() -> Endpoint:
        made.append(Endpoint())
        return made[-1]

    yield make
    for e in made:
        e.close()


def test_scrape_reads_totals_and_queues(endpoints):
    ep = endpoints()
    ep.samples.labels("producer").inc(5)
    ep.samples.labels("rewards").inc(2)
    ep.queued.labels("rollouts", "inbox").set(3)
    ep.queued.labels("scored", "outbox_not_taken").set(4)
    got = scrape(ep.port)
    assert got.total("rlbus_stage_samples_total") == 7
    assert got.total("rlbus_stage_samples_total", stage="rewards") == 2
    assert got.total("rlbus_stage_tokens_total") is None  # a family without any series yet: unknown
    assert got.total("rlbus_no_such_metric_total") is None
    stats = component_stats(None, got)
    assert stats["queues"] == {"rollouts/inbox": 3, "scored/outbox_not_taken": 4}
    assert stats["queue_depth"] == 7
    assert stats["throughput"] == {"samples_per_s": None, "tokens_per_s": None} and stats["busy"] is None


def test_rates_and_busy_fraction_between_two_scrapes(endpoints):
    ep = endpoints()
    ep.samples.labels("producer").inc(3)
    ep.busy.labels("producer").inc(1.0)
    ep.idle.labels("producer").inc(1.0)
    first = scrape(ep.port)
    ep.samples.labels("producer").inc(12)
    ep.tokens.labels("producer").inc(120)
    ep.busy.labels("producer").inc(0.3)
    ep.idle.labels("producer").inc(0.1)
    second = scrape(ep.port)
    dt = second.at - first.at
    assert dt > 0
    stats = component_stats(first, second)
    assert stats["throughput"]["samples_per_s"] == pytest.approx(12 / dt)
    assert stats["throughput"]["tokens_per_s"] == pytest.approx(120 / dt)
    assert stats["busy"] == pytest.approx(0.75)
    assert stats["queue_depth"] is None  # no queue series at all: unknown, not 0


def test_a_restarted_component_counts_from_zero(endpoints):
    """The same component scraped before and after a restart (a fresh process: a new endpoint
    whose counters start again from zero): the increase is the new value, never negative."""
    before, after = endpoints(), endpoints()
    before.samples.labels("rewards").inc(50)
    first = scrape(before.port)
    after.samples.labels("rewards").inc(6)
    second = scrape(after.port)
    assert component_stats(first, second)["throughput"]["samples_per_s"] == pytest.approx(6 / (second.at - first.at))
    assert counter_delta(50, 6) == 6 and counter_delta(6, 50) == 44


def test_parse_rejects_garbage_and_scrape_of_a_closed_port_raises():
    with pytest.raises(ValueError):
        parse_metrics('rlbus_x{stage="p" 1\n', 0.0)
    with pytest.raises(OSError):
        scrape(free_port(), timeout_s=0.5)


def test_poller_tolerates_dead_targets_and_keeps_rates(endpoints):
    live = endpoints()
    dead_port = free_port()
    poller = MetricsPoller(
        lambda: [("producer-0", "127.0.0.1", live.port), ("rewards-0", "127.0.0.1", dead_port)],
        interval_s=0.05,
        timeout_s=0.5,
    )
    first = poller.poll_once()
    assert set(first) == {"producer-0"} and "rewards-0" in poller.failures
    assert first["producer-0"]["throughput"]["samples_per_s"] is None  # one reading: no rate yet
    live.samples.labels("producer").inc(8)
    second = poller.poll_once()
    assert second["producer-0"]["throughput"]["samples_per_s"] > 0
    poller.start()  # the thread keeps polling until closed

    def tokens_flowing() -> bool:
        live.tokens.labels("producer").inc(100)  # a steady stream: every round sees an increase
        return (poller.stats["producer-0"]["throughput"]["tokens_per_s"] or 0) > 0

    try:
        wait_until(tokens_flowing, "the polling thread measured tokens/s", 10)
    finally:
        poller.close()
    assert poller._thread is None


def test_poller_rates_cover_a_sliding_window(endpoints):
    """Work done once stays in the rate while it is inside the window, and leaves it after."""
    ep = endpoints()
    poller = MetricsPoller(lambda: [("trainer", "127.0.0.1", ep.port)], window_s=0.5)
    poller.poll_once()
    ep.samples.labels("trainer").inc(16)  # one optimizer step's samples
    started = time.monotonic()
    rate = poller.poll_once()["trainer"]["throughput"]["samples_per_s"]
    assert rate > 0
    while time.monotonic() - started < 0.3:  # later readings within the window: still the step's rate
        assert poller.poll_once()["trainer"]["throughput"]["samples_per_s"] > 0
    wait_until(lambda: poller.poll_once()["trainer"]["throughput"]["samples_per_s"] == 0, "the step left the window", 5)
