"""TLS with client certificates for the metrics endpoints of an authenticated tcp:// run: every metrics server
asks for a client certificate of the run's CA, and the readers (busctl's poller and end-of-run snapshot,
Prometheus) check the server's certificate against the CA and the host they connect to. The files are made
by :mod:`telemetry.certs`; which certificate a server serves, the host-name check, and the old shared-
certificate layout (chain checked, no host name, logged) are in docs/ARCHITECTURE.md, "Authentication".
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

SERVER_NAME = "rlbus-metrics"  # DNS name of an old directory's shared server certificate
COMMON_FILES = ("ca.crt", "client.crt", "client.key")  # in DIR/tls of every layout
SHARED_FILES = ("server.crt", "server.key")  # an old directory's shared server certificate

_warned: set[tuple[str, str]] = set()  # (warning, tls_dir) already logged by this process


def _warn_once(kind: str, tls_dir: Path, message: str, *args) -> None:
    if (kind, str(tls_dir)) not in _warned:
        _warned.add((kind, str(tls_dir)))
        log.warning(message, *args)


def _normal(host: str) -> str:
    """``host`` as names are compared: an IP address canonical, a name in lower case."""
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host.lower().rstrip(".")


class TlsSettings(Protocol):
    """The fields of ``configs.schema.BusConfig`` read here."""

    transport: str
    curve_keys_dir: str


@dataclass(frozen=True)
class MetricsTls:
    """One run's certificate files, in ``tls_dir`` (``DIR/tls`` of the key directory)."""

    tls_dir: Path

    def path(self, name: str) -> Path:
        """``tls_dir / name``."""
        return self.tls_dir / name

    @property
    def per_host(self) -> bool:
        """Per-host server certificates (``hosts/*.crt``, host names checked), not an old shared one."""
        return any((self.tls_dir / HOSTS_DIR).glob("*.crt"))

    def host_certificates(self) -> dict[str, tuple[str, ...]]:
        """``{host: its certificate's names and addresses}`` of ``hosts/*.crt``; OSError/ValueError if unreadable."""
        return {p.stem: certificate_names(p) for p in sorted((self.tls_dir / HOSTS_DIR).glob("*.crt"))}

    @classmethod
    def load(cls, keys_dir: str | Path) -> "MetricsTls":
        """The certificate files of ``keys_dir``, checked to exist and to load.

        Raises:
            ValueError: a file is missing or does not load (names the path and the fix).
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
        """The certificate and key of a server bound at ``host``: the one naming ``host``, else the one naming
        this machine (logged: readers refuse it), else an old directory's shared one (logged once).

        Raises:
            ValueError: none names ``host`` or this machine, or its key is not here (names them and the fix).
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
        """A server context: :meth:`server_files`' certificate, client certificates of the CA required.

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
        """A scraper's context: the client certificate; a server of the CA naming the host connected to
        (``check_hostname``; an old shared certificate: the CA only, logged once).

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
        """A Prometheus job's ``tls_config`` (absolute paths); ``server_name`` only for an old shared certificate."""
        config = {
            "ca_file": str(self.path("ca.crt").resolve()),
            "cert_file": str(self.path("client.crt").resolve()),
            "key_file": str(self.path("client.key").resolve()),
        }
        return config if self.per_host else {**config, "server_name": SERVER_NAME}


def tls_from_config(bus: TlsSettings) -> MetricsTls | None:
    """The run's metrics TLS exactly when the bus is CurveZMQ-authenticated (tcp + ``curve_keys_dir``), else None.

    Raises:
        ValueError: see :meth:`MetricsTls.load`.
    """
    if bus.transport != "tcp" or not bus.curve_keys_dir:
        return None
    return MetricsTls.load(bus.curve_keys_dir)


def server_context_for(bus: TlsSettings, host: str = "127.0.0.1") -> ssl.SSLContext | None:
    """The server context of the run's metrics server bound at ``host``; None for plain HTTP.

    Raises:
        ValueError: see :meth:`MetricsTls.load` and :meth:`MetricsTls.server_files`.
    """
    tls = tls_from_config(bus)
    return tls.server_context(host) if tls is not None else None
