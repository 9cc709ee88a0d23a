"""A supervised tcp:// run with CurveZMQ keys serves its metrics over TLS (issue 31.1).

A real :class:`busctl.supervisor.Supervisor` over the real control hub and a
:mod:`tests.terminal.ticker` component (``component_main``, as every component), on
``bus.transport: tcp`` with keys from ``busctl keys``: the metrics poller reads the ticker over
HTTPS with the client certificate (``status.json`` gets its throughput), ``prometheus.yml``
scrapes ``https`` with the ``tls_config``, and neither the ticker's nor busctl's own endpoint
answers a client without the certificate.
"""

from __future__ import annotations

import random
import ssl
import urllib.request

import pytest
import yaml

from bus import auth
from telemetry.tls import MetricsTls
from busctl.scrape import fetch_metrics, scrape
from configs.schema import load_config
from tests.socket_dirs import remove_outside_socket_dir
from tests.terminal.test_supervised_metrics import TerminalRun, measured, ticker_table


@pytest.fixture
def tls_run(tmp_path):
    keys = tmp_path / "keys"
    auth.create_keys(keys)
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "name=ticks",
            "model.path=unused-by-ticker",
            "broadcast.method=filesystem",
            "bus.heartbeat_s=0.1",
            "bus.dead_after_s=5",
            "bus.ready_timeout_s=60",
            "bus.transport=tcp",
            f"bus.base_port={random.randrange(20_000, 32_000, 100)}",
            f"bus.curve_keys_dir={keys}",
        ],
    )
    run = TerminalRun(cfg, ticker_table("hub", "packer"))
    yield run, MetricsTls.load(keys)
    run.close()
    remove_outside_socket_dir(tmp_path / "run")


def test_the_poller_prometheus_and_only_certificate_holders_read_metrics_over_tls(tls_run):
    run, tls = tls_run
    rows = run.wait_rows("the packer measured over TLS", lambda r: measured(r["packer"]))
    port = rows["packer"]["metrics_port"]
    (job,) = yaml.safe_load((run.run_dir / "prometheus.yml").read_text())["scrape_configs"]
    assert job["scheme"] == "https" and job["tls_config"] == tls.prometheus_tls_config()
    targets = {s["labels"]["component"]: s["targets"] for s in job["static_configs"]}
    assert targets["packer"] == [f"127.0.0.1:{port}"] and targets["supervisor"] == [f"127.0.0.1:{run.sup.metrics_port}"]
    client = tls.client_context()
    bare = ssl.create_default_context(cafile=str(tls.path("ca.crt")))  # trusts the servers, holds no certificate
    bare.check_hostname = False
    for target in (port, run.sup.metrics_port):
        assert (
            scrape(target, timeout_s=10, tls=client).total("rlbus_bus_messages_total") is not None
        )  # the holder reads both
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{target}/metrics", timeout=5).read()  # plain HTTP: nothing
        with pytest.raises(OSError):
            fetch_metrics(target, timeout_s=5, tls=bare)  # TLS without the client certificate: refused
