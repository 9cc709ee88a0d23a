"""A real Prometheus scrapes a TLS metrics endpoint with the ``tls_config`` rlbus writes (issue 31.1).

A metrics server with client certificates required (``telemetry.metrics`` + ``telemetry.tls``, files
from ``busctl keys``), and the Debian ``prometheus`` binary given
:func:`busctl.run_status.scrape_config` with that ``tls_config``: the target is up and its counter
queryable. The same target scraped over plain HTTP, or over HTTPS without the client
certificate, is down.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter

from bus import auth
from telemetry.metrics import start_metrics_server
from telemetry.tls import MetricsTls
from busctl.run_status import scrape_config
from tests.observability.prometheus_server import PrometheusServer, fast_scrape_config

WAIT_S = 60.0


def test_prometheus_scrapes_the_tls_endpoint_with_the_generated_tls_config(prometheus_bin, tmp_path):
    keys = tmp_path / "keys"
    auth.create_keys(keys)
    tls = MetricsTls.load(keys)
    registry = CollectorRegistry()
    Counter("h8_tls_probe_total", "a probe", registry=registry).inc(5)
    srv = start_metrics_server(0, registry=registry, tls=tls.server_context())
    port = int(srv.server_address[1])
    config = scrape_config("tlsrun", [("packer", "packer", "127.0.0.1", port)], tls.prometheus_tls_config())
    plain = scrape_config("plainrun", [("packer", "packer", "127.0.0.1", port)])["scrape_configs"][0]
    no_cert = {k: v for k, v in tls.prometheus_tls_config().items() if k in ("ca_file", "server_name")}
    config["scrape_configs"] += [
        {**plain, "job_name": "plain-http"},
        {**plain, "job_name": "no-certificate", "scheme": "https", "tls_config": no_cert},
    ]
    server = PrometheusServer(prometheus_bin, tmp_path / "prom", fast_scrape_config(config))
    try:
        deadline = time.monotonic() + WAIT_S
        health: dict = {}
        while time.monotonic() < deadline:
            health = {t["labels"]["job"]: (t["health"], t.get("lastError", "")) for t in server.active_targets()}
            if len(health) == 3 and all(h != "unknown" for h, _ in health.values()):
                break
            time.sleep(0.5)
        assert health["rlbus"][0] == "up", (health, server.log_tail())
        assert health["plain-http"][0] == health["no-certificate"][0] == "down", health
        (row,) = server.api("query", query='h8_tls_probe_total{run="tlsrun"}')["result"]
        assert float(row["value"][1]) == 5.0
        assert server.api("query", query='h8_tls_probe_total{run="plainrun"}')["result"] == []
    finally:
        server.stop()
        srv.shutdown()
        srv.server_close()
