"""The metrics endpoint (``/metrics``, ``/health``), stage busy/idle accounting and the bus
series that exist from the first scrape."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import zmq
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from telemetry.metrics import REJECT_REASONS, REDELIVER_REASONS, StageMeter, serve_metrics
from bus.sockets import BusSocket

ROOT = Path(__file__).resolve().parents[2]


def fetch(port: int, path: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of a Prometheus text page."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_and_health_endpoints() -> None:
    registry = CollectorRegistry()
    counter = Counter("rlbus_test_things_total", "things", registry=registry)
    counter.inc(3)
    state = {"healthy": False}
    port = serve_metrics(
        0, health=lambda: (state["healthy"], {"component": "packer", "phase": "starting"}), registry=registry
    )

    code, ctype, text = fetch(port, "/metrics")
    assert code == 200 and ctype.startswith("text/plain")
    assert samples(text)[("rlbus_test_things_total", ())] == 3.0

    code, ctype, body = fetch(port, "/health")
    assert (code, ctype) == (503, "application/json")
    health = json.loads(body)
    assert health["status"] == "unhealthy" and health["component"] == "packer" and health["pid"] > 0
    state["healthy"] = True
    code, _, body = fetch(port, "/health")
    assert code == 200 and json.loads(body)["status"] == "ok"

    code, _, body = fetch(port, "/nope")
    assert code == 404 and "/metrics" in body


def test_stage_meter_counts_busy_time_while_an_item_is_in_work() -> None:
    meter = StageMeter("trainer")
    port = serve_metrics(0)
    before = samples(fetch(port, "/metrics")[2])
    release = threading.Event()

    def work() -> None:
        with meter.work():
            release.wait(5)

    time.sleep(0.2)  # idle
    first = threading.Thread(target=work)
    second = threading.Thread(target=work)  # overlapping items: busy time is not double-counted
    first.start()
    second.start()
    time.sleep(0.3)
    during = samples(fetch(port, "/metrics")[2])
    release.set()
    first.join()
    second.join()
    busy, idle = meter.seconds()

    stage = (("stage", "trainer"),)
    for name, least in (("rlbus_stage_busy_seconds_total", 0.25), ("rlbus_stage_idle_seconds_total", 0.15)):
        # seen mid-item; other trainer meters of this test process only add their own time
        assert during[(name, stage)] - before.get((name, stage), 0.0) >= least
    assert 0.25 <= busy < 1.5 and idle >= 0.15
    time.sleep(0.1)
    busy_later, idle_later = meter.seconds()
    assert busy_later == busy and idle_later >= idle + 0.09  # idle again after the items


def test_stage_meter_counts_samples_tokens_and_latency() -> None:
    meter = StageMeter("packer")
    before = samples(fetch(serve_metrics(0), "/metrics")[2])
    with meter.work():
        time.sleep(0.05)
    meter.finished(4, 120)
    after = samples(fetch(serve_metrics(0), "/metrics")[2])
    stage = (("stage", "packer"),)

    def delta(name: str) -> float:
        return after[(name, stage)] - before.get((name, stage), 0.0)

    assert delta("rlbus_stage_samples_total") == 4
    assert delta("rlbus_stage_tokens_total") == 120
    assert delta("rlbus_stage_latency_seconds_count") == 1
    assert delta("rlbus_stage_latency_seconds_sum") >= 0.05


def test_stage_meter_refuses_an_unknown_stage() -> None:
    with pytest.raises(ValueError, match="unknown stage 'generator'"):
        StageMeter("generator")


def test_a_socket_exports_its_topic_series_before_any_traffic() -> None:
    ctx = zmq.Context()
    endpoint = f"inproc://metrics-{time.monotonic_ns()}"
    sock = BusSocket(ctx, "control_pub", "send", endpoint, bind=True)
    try:
        page = samples(fetch(serve_metrics(0), "/metrics")[2])
    finally:
        sock.close()
        ctx.term()
    topic = (("topic", "control"),)
    assert page[("rlbus_bus_messages_total", (("direction", "send"), *topic))] >= 0
    assert page[("rlbus_bus_blocked_seconds_total", topic)] >= 0
    for reason in REJECT_REASONS:
        assert (("rlbus_bus_rejected_total", (("reason", reason), *topic))) in page


def test_every_reason_in_the_code_is_declared() -> None:
    """Reject and redelivery reasons are pre-declared (series at 0 from the start), so the code
    must use no reason the lists lack."""
    code = "\n".join(p.read_text() for p in (ROOT / "bus").glob("*.py"))
    rejects = set(re.findall(r'WireError\(\s*"(\w+)"', code)) | set(re.findall(r'reject\(\s*"(\w+)"', code))
    assert rejects and rejects <= set(REJECT_REASONS), rejects - set(REJECT_REASONS)
    requeues = set(re.findall(r'_requeue\([^)]*,\s*"(\w+)"\)', code)) | set(
        re.findall(r'peer_lost\(\w+,\s*"(\w+)"\)', code)
    )
    assert requeues and requeues <= set(REDELIVER_REASONS), requeues - set(REDELIVER_REASONS)
