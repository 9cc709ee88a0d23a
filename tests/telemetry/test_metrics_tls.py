"""The metrics endpoints over TLS with client certificates (telemetry.tls, issue 31.1).

Real servers (``telemetry.metrics.serve_metrics`` with the server context made from ``busctl keys``
files) on 127.0.0.1, real clients (``busctl.scrape``, ``urllib``, ``ssl``): the holder of the
run's client certificate reads ``/metrics`` and ``/health``; a client without a certificate, with
a certificate of another run's CA, or speaking plain HTTP reads nothing and is counted; the
scraper refuses a server of another CA; ``prometheus.yml`` carries the ``tls_config``.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter

from bus import auth
from telemetry.metrics import METRICS_TLS_REFUSED, start_metrics_server
from telemetry.tls import MetricsTls, tls_from_config
from busctl.run_status import scrape_config
from busctl.scrape import fetch_metrics, metrics_url, scrape
from configs.schema import load_config


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "k"
    auth.create_keys(path)
    return path


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory) -> Path:
    """Another run's key directory: another CA."""
    path = tmp_path_factory.mktemp("other") / "k"
    auth.create_keys(path)
    return path


@pytest.fixture
def server(keys):
    """A TLS metrics server with a registry of its own; yields its port."""
    registry = CollectorRegistry()
    Counter("h8_probe_total", "a probe", registry=registry).inc(3)
    srv = start_metrics_server(
        0, health=lambda: (True, {"component": "probe"}), registry=registry, tls=MetricsTls.load(keys).server_context()
    )
    yield int(srv.server_address[1])
    srv.shutdown()
    srv.server_close()


def _refused() -> float:
    return METRICS_TLS_REFUSED._value.get()


def test_the_client_certificate_reads_metrics_and_health(server, keys):
    client = MetricsTls.load(keys).client_context()
    got = scrape(server, timeout_s=10, tls=client)
    assert got.total("h8_probe_total") == 3.0
    with urllib.request.urlopen(metrics_url(server, tls=client, path="/health"), timeout=5, context=client) as resp:
        body = json.loads(resp.read())
    assert resp.status == 200 and body["status"] == "ok" and body["component"] == "probe"


def _handshake_alert(port: int, ctx: ssl.SSLContext) -> str:
    """What a client of ``ctx`` reads after its TLS handshake, sending nothing: the reason of the
    server's TLS alert (TLS 1.3 judges the client certificate after the client's handshake ends; a
    request sent first can turn the alert into an EOF), else the error or the bytes read."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                return repr(tls.recv(1))
        except ssl.SSLError as err:
            return str(err.reason)
        except OSError as err:
            return type(err).__name__


def test_a_client_without_the_certificate_gets_no_metrics(server, keys, other_keys):
    before = _refused()
    no_cert = ssl.create_default_context(cafile=str(MetricsTls.load(keys).path("ca.crt")))
    no_cert.check_hostname = False  # trusts the server: only the missing client certificate differs
    foreign = MetricsTls.load(other_keys).client_context()  # a certificate of another CA ...
    foreign.load_verify_locations(MetricsTls.load(keys).path("ca.crt"))  # ... that trusts this server
    for ctx, alert in ((no_cert, "TLSV13_ALERT_CERTIFICATE_REQUIRED"), (foreign, "TLSV1_ALERT_UNKNOWN_CA")):
        with pytest.raises(OSError):  # the scraper gets the alert, or EOF
            fetch_metrics(server, timeout_s=5, tls=ctx)
        assert _handshake_alert(server, ctx) == alert  # refused in the handshake, for its certificate
    with pytest.raises(OSError):  # plain HTTP to the TLS port: no HTTP answer at all
        urllib.request.urlopen(f"http://127.0.0.1:{server}/health", timeout=5).read()
    with socket.create_connection(("127.0.0.1", server), timeout=5) as raw:  # raw bytes: nothing comes back
        raw.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        try:
            reply = raw.recv(65536)
        except (ConnectionResetError, TimeoutError):
            reply = b""
        assert b"h8_probe_total" not in reply and b"HTTP/" not in reply
    deadline = time.monotonic() + 5
    while _refused() - before < 6 and time.monotonic() < deadline:  # counted in each request's thread
        time.sleep(0.05)
    assert _refused() - before == 6


def test_the_scraper_refuses_a_server_of_another_ca(server, other_keys):
    with pytest.raises(urllib.error.URLError) as err:
        scrape(server, timeout_s=5, tls=MetricsTls.load(other_keys).client_context())
    assert isinstance(err.value.reason, ssl.SSLCertVerificationError)


def test_tls_follows_the_authenticated_bus_and_prometheus_gets_its_tls_config(keys, tmp_path):
    tcp = load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={keys}"]).bus
    assert tls_from_config(tcp) == MetricsTls(keys / "tls")
    assert tls_from_config(load_config(None, [f"bus.curve_keys_dir={keys}"]).bus) is None  # ipc: loopback, plain
    assert tls_from_config(load_config(None, ["bus.transport=tcp"]).bus) is None  # unauthenticated bus
    config = scrape_config(
        "r", [("trainer", "trainer", "10.0.0.1", 9100)], MetricsTls(keys / "tls").prometheus_tls_config()
    )
    (job,) = yaml.safe_load(yaml.safe_dump(config))["scrape_configs"]
    assert (
        job["scheme"] == "https" and "server_name" not in job["tls_config"]
    )  # per-host certificates: the target's host
    for field, name in (("ca_file", "ca.crt"), ("cert_file", "client.crt"), ("key_file", "client.key")):
        assert Path(job["tls_config"][field]) == (keys / "tls" / name).resolve()
    assert "scheme" not in scrape_config("r", [("trainer", "trainer", "127.0.0.1", 9100)])["scrape_configs"][0]


def test_a_key_directory_without_tls_fails_the_launch_check_and_busctl_keys_adds_it(tmp_path):
    old = tmp_path / "old"
    auth.create_keys(old)
    shutil.rmtree(old / "tls")  # a key directory from before the metrics TLS
    bus = load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={old}"]).bus
    with pytest.raises(ValueError, match=r"bus.curve_keys_dir: metrics TLS file.*ca\.crt.*busctl keys"):
        auth.check_keys(bus)
    auth.check_keys(load_config(None, [f"bus.curve_keys_dir={old}"]).bus)  # ipc uses no TLS
    public_before = (old / "server.key").read_bytes()
    added = auth.create_keys(old)
    assert [p.relative_to(old / "tls").as_posix() for p in added] == [
        "ca.crt",
        f"hosts/{added[1].stem}.crt",
        f"hosts/{added[1].stem}.key",
        "client.crt",
        "client.key",
    ]  # this machine's
    assert (old / "server.key").read_bytes() == public_before  # CurveZMQ keys untouched
    assert oct((old / "tls" / "hosts" / f"{added[1].stem}.key").stat().st_mode & 0o777) == "0o600"
    auth.check_keys(bus)
    with pytest.raises(ValueError, match="already holds CurveZMQ keys and metrics TLS"):
        auth.create_keys(old)
