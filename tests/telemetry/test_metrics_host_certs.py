"""One metrics TLS server certificate per host, and readers that check the host name (telemetry.certs).

Real metrics servers (``telemetry.metrics.start_metrics_server``) on loopback addresses (127.0.0.1 and
127.0.0.2 are two "hosts" of one machine), certificates from ``busctl keys`` (its real command
line, ``cryptography``), real readers (``busctl.scrape`` over ``urllib`` + ``ssl``): a server with
its own host's certificate is read by its address; a reader connecting to an address that the
served certificate does not name (another host's stolen key, or a name the certificate lacks) is
refused; a key directory from before per-host certificates (one shared ``server.crt``) still
serves and is read, without the host-name check.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from bus import auth
from telemetry.metrics import start_metrics_server
from telemetry.certs import HostNames, certificate_names, node_hosts, parse_hosts
from telemetry.tls import SERVER_NAME, MetricsTls
from busctl.scrape import scrape

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    """Two hosts: alpha at 127.0.0.1, beta at 127.0.0.2 (made by the real ``busctl keys``)."""
    path = tmp_path_factory.mktemp("keys") / "k"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "busctl",
            "keys",
            str(path),
            "--no-resolve",
            "--hosts",
            "alpha=127.0.0.1,beta=127.0.0.2+beta.example",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "tls/hosts/alpha.crt: alpha, 127.0.0.1" in out.stdout
        and "tls/hosts/beta.crt: beta, 127.0.0.2, beta.example" in out.stdout
    )
    return path


@pytest.fixture
def serve():
    """Start metrics servers (``serve(host, tls_context)``) with a probe counter; yields the
    starter, returns each one's port; all are closed after the test."""
    servers = []

    def start(host: str, tls: ssl.SSLContext) -> int:
        registry = CollectorRegistry()
        Counter("hz_probe_total", "a probe", registry=registry).inc(5)
        srv = start_metrics_server(0, host, registry=registry, tls=tls)
        servers.append(srv)
        return int(srv.server_address[1])

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _mismatch(err: pytest.ExceptionInfo) -> bool:
    reason = getattr(err.value, "reason", err.value)
    return isinstance(reason, ssl.SSLCertVerificationError) and "mismatch" in str(reason)


def test_busctl_keys_writes_one_certificate_per_host_and_each_host_serves_its_own(keys):
    tls = MetricsTls.load(keys)
    assert tls.per_host and tls.host_certificates() == {
        "alpha": ("alpha", "127.0.0.1"),
        "beta": ("beta", "beta.example", "127.0.0.2"),
    }
    assert sorted(p.name for p in (keys / "tls" / "hosts").iterdir()) == [
        "alpha.crt",
        "alpha.key",
        "beta.crt",
        "beta.key",
    ]
    assert oct((keys / "tls" / "hosts" / "beta.key").stat().st_mode & 0o777) == "0o600"
    assert tls.server_files("127.0.0.1")[0].name == "alpha.crt" and tls.server_files("127.0.0.2")[0].name == "beta.crt"
    assert tls.server_files("BETA.example")[0].name == "beta.crt"  # names compare case-insensitively
    assert "server_name" not in tls.prometheus_tls_config()  # Prometheus checks each target's own host
    with pytest.raises(
        ValueError,
        match=r"no server certificate in .*hosts names 10\.9\.9\.9 .*alpha: alpha, 127\.0\.0\.1"
        r".*--hosts NAME=10\.9\.9\.9",
    ):
        tls.server_files("10.9.9.9")  # a host the directory was not made for (and not this machine)


def test_a_reader_reads_each_host_by_its_address(keys, serve):
    tls = MetricsTls.load(keys)
    client = tls.client_context()
    assert client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED
    for host in ("127.0.0.1", "127.0.0.2"):
        port = serve(host, tls.server_context(host))
        assert scrape(port, host, timeout_s=10, tls=client).total("hz_probe_total") == 5.0


def test_a_reader_refuses_a_certificate_that_does_not_name_the_host_it_connects_to(keys, serve):
    tls = MetricsTls.load(keys)
    client = tls.client_context()
    stolen = serve("127.0.0.1", tls.server_context("127.0.0.2"))  # beta's key serving at alpha's address
    with pytest.raises(urllib.error.URLError) as err:
        scrape(stolen, "127.0.0.1", timeout_s=10, tls=client)
    assert _mismatch(err)
    own = serve("127.0.0.1", tls.server_context("127.0.0.1"))  # alpha's own certificate names 127.0.0.1 only ...
    with pytest.raises(urllib.error.URLError) as err:
        scrape(own, "localhost", timeout_s=10, tls=client)  # ... not localhost: refused though the chain is good
    assert _mismatch(err)


def test_a_host_without_its_key_gets_a_clear_error_and_the_readers_still_load(keys, tmp_path):
    copy = tmp_path / "k"
    shutil.copytree(keys, copy)
    (copy / "tls" / "hosts" / "alpha.key").unlink()  # this host holds beta's key only
    tls = MetricsTls.load(copy)  # the readers need no server key
    assert tls.server_files("127.0.0.2")[0].name == "beta.crt"
    with pytest.raises(ValueError, match=r"alpha\.crt names 127\.0\.0\.1 but its key .*alpha\.key is not on this host"):
        tls.server_context("127.0.0.1")


def _old_layout(path: Path) -> Path:
    """A key directory as ``busctl keys`` made it before per-host certificates: one shared
    ``tls/server.crt`` (DNS names rlbus-metrics, localhost and 127.0.0.1), no ``tls/hosts/``."""
    auth.create_keys(path, hosts=[HostNames(SERVER_NAME, ("localhost", "127.0.0.1"))])
    for ext in ("crt", "key"):
        os.replace(path / "tls" / "hosts" / f"{SERVER_NAME}.{ext}", path / "tls" / f"server.{ext}")
    (path / "tls" / "hosts").rmdir()
    return path


def test_an_old_key_directory_with_one_shared_certificate_still_works(tmp_path, serve, caplog):
    tls = MetricsTls.load(_old_layout(tmp_path / "old"))
    assert not tls.per_host and tls.prometheus_tls_config()["server_name"] == SERVER_NAME
    with caplog.at_level(logging.WARNING, logger="telemetry.tls"):
        client = tls.client_context()
        tls.client_context()
        ctx = tls.server_context("127.0.0.2")  # any host serves the shared certificate
    assert not client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED
    warned = [r.getMessage() for r in caplog.records]
    assert len([m for m in warned if "readers check the CA but not host names" in m]) == 1, warned  # once per process
    assert any("one server certificate shared by every host" in m for m in warned), warned
    port = serve("127.0.0.2", ctx)  # the shared certificate does not name 127.0.0.2: read all the same
    assert scrape(port, "127.0.0.2", timeout_s=10, tls=client).total("hz_probe_total") == 5.0
    with pytest.raises(urllib.error.URLError):  # the CA is still checked: another run's reader is refused
        scrape(port, "127.0.0.2", timeout_s=10, tls=MetricsTls.load(_old_layout(tmp_path / "other")).client_context())


def test_hosts_spec_and_node_hosts():
    assert parse_hosts("node1=10.0.0.1, node2=10.0.0.2+Node2.Example") == [
        HostNames("node1", ("10.0.0.1",)),
        HostNames("node2", ("10.0.0.2", "node2.example")),
    ]
    for bad, why in (
        ("a,,b", "item 2.*empty host"),
        ("a=10.0.0.300", "neither an IP address nor a host name"),
        ("a,a", "host a given twice"),
        ("under_score", "neither"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_hosts(bad)
    assert node_hosts({"n1": "10.0.0.1", "n2": "10.0.0.2", "head": "10.0.0.1", "f" * 56: "10.0.0.3"}) == [
        HostNames("n1", ("10.0.0.1",)),
        HostNames("n2", ("10.0.0.2",)),
        HostNames("f" * 56, ("10.0.0.3",)),
    ]
    resolved = HostNames("localhost").with_addresses()
    assert "127.0.0.1" in resolved.all and resolved.name == "localhost"


def test_busctl_keys_refuses_a_bad_hosts_spec(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "busctl", "keys", str(tmp_path / "k"), "--hosts", "a=not a host"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert out.returncode == 1 and "--hosts item 1" in out.stderr and not (tmp_path / "k").exists()


def test_a_multihost_launch_makes_one_certificate_per_node(tmp_path):
    from busctl.launchers.multihost import configure_multihost
    from busctl.launchers.nodes import Allocation
    from configs.schema import load_config

    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}"])
    resolve = {"n1": "10.0.0.1", "n2": "10.0.0.2", socket.gethostname(): "10.0.0.1"}.get
    configure_multihost(
        cfg, Allocation((("n1", "n2"),)), resolve=resolve, supervisor_host=socket.gethostname(), here="n1"
    )
    tls = MetricsTls.load(cfg.bus.curve_keys_dir)
    assert tls.host_certificates() == {"n1": ("n1", "10.0.0.1"), "n2": ("n2", "10.0.0.2")}
    assert certificate_names(tls.server_files("10.0.0.2")[0]) == ("n2", "10.0.0.2")


def test_the_ray_launcher_sends_each_node_only_its_own_server_key(keys, tmp_path):
    pytest.importorskip("ray")
    from busctl.launchers.ray import RayLauncher

    (tmp_path / "config.yaml").write_text("name: r\n")
    launcher = RayLauncher.__new__(RayLauncher)  # files() reads only these two (no Ray cluster needed)
    launcher.run_dir, launcher.keys_dir = tmp_path, str(keys)
    sent = {Path(p).relative_to(keys).as_posix() for p in launcher.files("127.0.0.2") if Path(p).is_relative_to(keys)}
    assert {"tls/hosts/beta.key", "tls/hosts/alpha.crt", "tls/hosts/beta.crt", "tls/client.key", "tls/ca.crt"} <= sent
    assert "tls/hosts/alpha.key" not in sent
    assert "tls/hosts/alpha.key" in {
        Path(p).relative_to(keys).as_posix() for p in launcher.files() if Path(p).is_relative_to(keys)
    }


def test_busctl_up_refuses_keys_without_a_certificate_for_its_host(keys, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    auth.create_keys(elsewhere, hosts=[HostNames("far", ("10.9.9.9",))])
    args = [sys.executable, "-m", "busctl", "up", "--dry-run", "bus.transport=tcp", f"run_dir={tmp_path / 'run'}"]
    out = subprocess.run(
        [*args, f"bus.curve_keys_dir={elsewhere}"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 2 and "no server certificate" in out.stderr and "far: far, 10.9.9.9" in out.stderr, (
        out.stderr
    )
    out = subprocess.run([*args, f"bus.curve_keys_dir={keys}"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr  # alpha names 127.0.0.1, where a local run serves its metrics
