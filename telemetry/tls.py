"""TLS with client certificates for the metrics endpoints (``/metrics``, ``/health``) of a tcp:// run.

A component serves its metrics on its node's address when its run spans nodes
(:mod:`lifecycle.launch_env`); over plain HTTP anyone who reaches that address could read them. When
the bus is authenticated (``bus.transport: tcp`` with ``bus.curve_keys_dir``, :mod:`bus.auth`),
every metrics server (each component's, busctl's own) is served over TLS and asks for a client
certificate signed by the run's CA (``ssl.CERT_REQUIRED``): a client without one fails the
handshake and reads nothing. The readers present the client certificate and check the server's
against the same CA and the name they connect to: the supervisor's metrics poller (behind
``status.json`` / ``busctl status``, :mod:`busctl.scrape`), its end-of-run snapshot, and
Prometheus (``tls_config`` in the generated ``prometheus.yml``, :meth:`MetricsTls.prometheus_tls_config`).

Certificate files: made by ``busctl keys DIR [--hosts ...]`` (:mod:`telemetry.certs`, which
describes the layout): ``DIR/tls/ca.crt``, one server certificate per host in
``DIR/tls/hosts/NAME.crt`` (+ ``.key``) and ``DIR/tls/client.crt`` (+ ``.key``).

- Which server certificate (:meth:`MetricsTls.server_files`): the one whose subjectAltName holds
  the address the server binds (``127.0.0.1`` locally, the node's address from its launcher on
  several nodes, :mod:`lifecycle.launch_env`); else the one naming this machine's host name (logged:
  readers connecting at the address will refuse it); else, in a key directory from before
  per-host certificates, the shared ``DIR/tls/server.crt`` (logged once per process).
- Host-name check (:meth:`MetricsTls.client_context`): with per-host certificates the readers
  verify the chain and that the certificate names the host they connect to
  (``check_hostname=True``; IP addresses match IP entries, RFC 6125). A key directory from before
  (``DIR/tls/server.crt`` shared by every host, DNS name :data:`SERVER_NAME`, no ``hosts/``) keeps
  working as it did, with the chain verified but no host-name check (logged once per process):
  one stolen key there impersonates every host, so make a new directory with ``--hosts``.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from telemetry.certs import CLIENT_NAME, HOSTS_DIR, TLS_DIR, VALID_DAYS, certificate_names, create_tls

__all__ = [
    "CLIENT_NAME",
    "SERVER_NAME",
    "TLS_DIR",
    "VALID_DAYS",
    "MetricsTls",
    "create_tls",
    "server_context_for",
    "tls_from_config",
]

log = logging.getLogger(__name__)

SERVER_NAME = "rlbus-metrics"
"""DNS name of the shared server certificate of a key directory from before per-host certificates
(Prometheus' ``tls_config.server_name`` there)."""

COMMON_FILES = ("ca.crt", "client.crt", "client.key")
"""The files of ``DIR/tls`` every layout has."""

SHARED_FILES = ("server.crt", "server.key")
"""The shared server certificate of a key directory from before per-host certificates."""

_warned: set[tuple[str, str]] = set()
"""(warning, tls_dir) already logged by this process."""


def _warn_once(kind: str, tls_dir: Path, message: str, *args) -> None:
    if (kind, str(tls_dir)) not in _warned:
        _warned.add((kind, str(tls_dir)))
        log.warning(message, *args)


def _normal(host: str) -> str:
    """``host`` as certificate names are compared: an IP address in canonical form, a name in lower case."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host.lower().rstrip(".")


class TlsSettings(Protocol):
    """The ``bus`` config fields (``configs.schema.BusConfig``) that :func:`tls_from_config` reads."""

    transport: str
    curve_keys_dir: str


@dataclass(frozen=True)
class MetricsTls:
    """Where one run's certificate files are.

    Attributes:
        tls_dir: ``DIR/tls`` of the key directory.
    """

    tls_dir: Path

    def path(self, name: str) -> Path:
        """``tls_dir / name`` (``name``: ``ca.crt``, ``client.key``, ``hosts/NAME.crt`` ...)."""
        return self.tls_dir / name

    @property
    def per_host(self) -> bool:
        """Whether the directory holds per-host server certificates (``hosts/*.crt``), so readers
        check host names; False for a key directory from before them (one shared certificate)."""
        return any((self.tls_dir / HOSTS_DIR).glob("*.crt"))

    def host_certificates(self) -> dict[str, tuple[str, ...]]:
        """``{host name: names and addresses of its certificate}`` of ``hosts/*.crt`` (sorted by name).

        Raises:
            OSError / ValueError: a certificate does not read.
        """
        return {p.stem: certificate_names(p) for p in sorted((self.tls_dir / HOSTS_DIR).glob("*.crt"))}

    @classmethod
    def load(cls, keys_dir: str | Path) -> "MetricsTls":
        """The certificate files of ``keys_dir`` (checked to exist and to load).

        Raises:
            ValueError: a file is missing or does not load as a certificate/key pair (names the path
                and how to make it).
        """
        tls = cls(Path(keys_dir) / TLS_DIR)
        hint = f"add them with `busctl keys {keys_dir}` (it adds the TLS files to an existing key directory)"
        per_host = tls.per_host
        missing = [str(tls.path(n)) for n in COMMON_FILES if not tls.path(n).is_file()]
        if not per_host:
            missing += [str(tls.path(n)) for n in SHARED_FILES if not tls.path(n).is_file()]
        if missing:
            raise ValueError(
                f"metrics TLS file(s) {', '.join(missing)} missing (and no server certificate in "
                f"{tls.path(HOSTS_DIR)}); {hint}"
            )
        # a host holds only its own server key (the others' certificates only): the pairs here are checked
        servers = (
            [crt for crt in sorted(tls.path(HOSTS_DIR).glob("*.crt")) if crt.with_suffix(".key").exists()]
            if per_host
            else [tls.path("server.crt")]
        )
        try:
            for crt in servers:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(crt, crt.with_suffix(".key"))
            tls._client_context()
        except (ssl.SSLError, OSError) as err:
            raise ValueError(f"metrics TLS files in {tls.tls_dir} do not load ({err}); {hint}") from None
        return tls

    def server_files(self, host: str) -> tuple[Path, Path]:
        """The certificate and key a metrics server bound at ``host`` serves (module docstring:
        the one naming ``host``, else the one naming this machine, else the shared one).

        Args:
            host: the address (or name) the server binds and readers connect to, e.g. ``127.0.0.1``
                or a node's address.

        Raises:
            ValueError: per-host certificates, none naming ``host`` or this machine, or the one naming
                it without its key here (names the host, the certificates' names and the fix).
        """
        if not self.per_host:
            _warn_once(
                "shared",
                self.tls_dir,
                "metrics TLS: %s holds one server certificate shared by every host "
                "(made before per-host certificates): served, but readers cannot check host names; make a new "
                "key directory with `busctl keys NEWDIR --hosts ...`",
                self.tls_dir,
            )
            return self.path("server.crt"), self.path("server.key")
        certs = self.host_certificates()
        for wanted in (_normal(h()) for h in (lambda: host, socket.gethostname, socket.getfqdn)):  # lazily: DNS last
            for stem, names in certs.items():
                if wanted in names:
                    if wanted != _normal(host):
                        _warn_once(
                            f"host:{host}",
                            self.tls_dir,
                            "metrics TLS: no certificate in %s names %s; serving "
                            "this machine's (%s), which readers connecting at %s refuse",
                            self.path(HOSTS_DIR),
                            host,
                            stem,
                            host,
                        )
                    crt = self.path(f"{HOSTS_DIR}/{stem}.crt")
                    if not crt.with_suffix(".key").is_file():
                        raise ValueError(
                            f"metrics TLS: {crt} names {wanted} but its key {crt.with_suffix('.key')} is "
                            "not on this host; copy it here from the key directory `busctl keys` made"
                        )
                    return crt, crt.with_suffix(".key")
        raise ValueError(
            f"metrics TLS: no server certificate in {self.path(HOSTS_DIR)} names {host} (where this "
            f"metrics server binds) or this machine ({socket.gethostname()}); certificates: "
            + "; ".join(f"{s}: {', '.join(n)}" for s, n in certs.items())
            + f". Make a key directory naming it: `busctl keys NEWDIR --hosts NAME={host}`"
        )

    def server_context(self, host: str = "127.0.0.1") -> ssl.SSLContext:
        """The TLS context of a metrics server bound at ``host``: the certificate of
        :meth:`server_files`, client certificates required and verified against the CA (TLS >= 1.2,
        ``ssl.create_default_context`` settings).

        Raises:
            ValueError: see :meth:`server_files`. ssl.SSLError / OSError: a file does not load.
        """
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.path("ca.crt")))
        ctx.load_cert_chain(*self.server_files(host))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def _client_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.path("ca.crt")))
        ctx.check_hostname = self.per_host  # set before verify_mode; the chain is verified either way
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.path("client.crt"), self.path("client.key"))
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """The TLS context of a scraper: presents the client certificate, accepts only a server
        certificate of the CA and, with per-host certificates, only one naming the host connected
        to (``check_hostname``; a key directory from before them: no host-name check, logged once).

        Raises:
            ssl.SSLError / OSError: a file does not load.
        """
        if not self.per_host:
            _warn_once(
                "reader",
                self.tls_dir,
                "metrics TLS: %s has one shared server certificate: readers check the "
                "CA but not host names; make a new key directory with `busctl keys NEWDIR --hosts ...`",
                self.tls_dir,
            )
        return self._client_context()

    def prometheus_tls_config(self) -> dict:
        """``tls_config`` of a Prometheus scrape job for these servers (absolute paths). With per-host
        certificates it has no ``server_name``: Prometheus checks each target's host against its
        certificate; the shared certificate of an older directory is checked as :data:`SERVER_NAME`."""
        config = {
            "ca_file": str(self.path("ca.crt").resolve()),
            "cert_file": str(self.path("client.crt").resolve()),
            "key_file": str(self.path("client.key").resolve()),
        }
        return config if self.per_host else {**config, "server_name": SERVER_NAME}


def tls_from_config(bus: TlsSettings) -> MetricsTls | None:
    """The metrics TLS of a run (``bus``: its ``bus`` section): on exactly when the bus is
    CurveZMQ-authenticated (``transport`` tcp and ``curve_keys_dir`` set, :func:`bus.auth.keys_from_config`),
    else None (plain HTTP: on ipc:// runs the metrics listen on 127.0.0.1 only).

    Raises:
        ValueError: see :meth:`MetricsTls.load`.
    """
    if bus.transport != "tcp" or not bus.curve_keys_dir:
        return None
    return MetricsTls.load(bus.curve_keys_dir)


def server_context_for(bus: TlsSettings, host: str = "127.0.0.1") -> ssl.SSLContext | None:
    """The TLS context of a metrics server of a run bound at ``host`` (:func:`tls_from_config`,
    :meth:`MetricsTls.server_context`), None for plain HTTP.

    Raises:
        ValueError: see :meth:`MetricsTls.load` and :meth:`MetricsTls.server_files`.
    """
    tls = tls_from_config(bus)
    return tls.server_context(host) if tls is not None else None
