"""TLS with client certificates for the metrics endpoints (``/metrics``, ``/health``) of a tcp:// run.

A component serves its metrics on its node's address when its run spans nodes
(:mod:`bus.launch_env`); over plain HTTP anyone who reaches that address could read them. When
the bus is authenticated (``bus.transport: tcp`` with ``bus.curve_keys_dir``, :mod:`bus.auth`),
every metrics server (each component's, busctl's own) is served over TLS and asks for a client
certificate signed by the run's CA (``ssl.CERT_REQUIRED``): a client without one fails the
handshake and reads nothing. The readers present the client certificate and check the server's
against the same CA: the supervisor's metrics poller (behind ``status.json`` / ``busctl status``,
:mod:`busctl.scrape`), its end-of-run snapshot, and Prometheus (``tls_config`` in the generated
``prometheus.yml``, :func:`prometheus_tls_config`).

Certificate files (made by ``busctl keys DIR`` beside the CurveZMQ keys, :func:`create_tls`)::

    DIR/tls/ca.crt                    the run's CA (self-signed); its private key is not kept
    DIR/tls/server.crt, server.key    every metrics server's certificate (CN and DNS name
                                      :data:`SERVER_NAME`), shared by every host like the
                                      CurveZMQ server keypair
    DIR/tls/client.crt, client.key    the scrapers' client certificate (CN ``rlbus-scraper``)

Keys are ECDSA P-256, certificates valid :data:`VALID_DAYS` days (``cryptography`` x509 API).
Servers may run on any node address, and they all hold the same certificate, so the check of a
server is "holds a certificate of this CA" (Python readers: ``check_hostname`` off, chain
verified; Prometheus: ``server_name`` :data:`SERVER_NAME`, which the certificate names).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

TLS_DIR = "tls"
"""Subdirectory of the key directory holding the certificates."""

SERVER_NAME = "rlbus-metrics"
"""DNS name in every metrics server's certificate (Prometheus' ``tls_config.server_name``)."""

CLIENT_NAME = "rlbus-scraper"
"""Common name of the scrapers' client certificate."""

VALID_DAYS = 825
"""Validity of the CA, server and client certificates, days (825: the longest browsers accept for a server)."""

FILES = ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")
"""The files of ``DIR/tls``."""


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
        """``tls_dir / name`` (``name``: one of :data:`FILES`)."""
        return self.tls_dir / name

    @classmethod
    def load(cls, keys_dir: str | Path) -> "MetricsTls":
        """The certificate files of ``keys_dir`` (checked to exist and to load).

        Raises:
            ValueError: a file is missing or does not load as a certificate/key pair (names the path
                and how to make it).
        """
        tls = cls(Path(keys_dir) / TLS_DIR)
        hint = f"add them with `busctl keys {keys_dir}` (it adds the TLS files to an existing key directory)"
        missing = [str(tls.path(n)) for n in FILES if not tls.path(n).is_file()]
        if missing:
            raise ValueError(f"metrics TLS file(s) {', '.join(missing)} missing; {hint}")
        try:
            tls.server_context()
            tls.client_context()
        except (ssl.SSLError, OSError) as err:
            raise ValueError(f"metrics TLS files in {tls.tls_dir} do not load ({err}); {hint}") from None
        return tls

    def server_context(self) -> ssl.SSLContext:
        """The TLS context of a metrics server: its certificate, client certificates required and
        verified against the CA (TLS >= 1.2, ``ssl.create_default_context`` settings).

        Raises:
            ssl.SSLError / OSError: a file does not load.
        """
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.path("ca.crt")))
        ctx.load_cert_chain(self.path("server.crt"), self.path("server.key"))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """The TLS context of a scraper: presents the client certificate and accepts only a server
        certificate of the CA (the host name is not compared: every node shares one certificate).

        Raises:
            ssl.SSLError / OSError: a file does not load.
        """
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.path("ca.crt")))
        ctx.check_hostname = False  # before verify_mode; the chain is still verified (CERT_REQUIRED)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_cert_chain(self.path("client.crt"), self.path("client.key"))
        return ctx

    def prometheus_tls_config(self) -> dict:
        """``tls_config`` of a Prometheus scrape job for these servers (absolute paths)."""
        return {"ca_file": str(self.path("ca.crt").resolve()), "cert_file": str(self.path("client.crt").resolve()),
                "key_file": str(self.path("client.key").resolve()), "server_name": SERVER_NAME}


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


def server_context_for(bus: TlsSettings) -> ssl.SSLContext | None:
    """The metrics server's TLS context of a run (:func:`tls_from_config`), None for plain HTTP.

    Raises:
        ValueError: see :meth:`MetricsTls.load`.
    """
    tls = tls_from_config(bus)
    return tls.server_context() if tls is not None else None


def _write(path: Path, data: bytes, secret: bool) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def create_tls(keys_dir: str | Path) -> list[Path]:
    """Create ``keys_dir/tls`` (mode 0700): a CA, the server and the client certificates (module
    docstring); private keys are written 0600 and the CA's private key is discarded.

    Returns:
        The created files, in :data:`FILES` order.

    Raises:
        ValueError: ``keys_dir/tls`` already exists (never overwritten).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    tls_dir = Path(keys_dir) / TLS_DIR
    if tls_dir.exists():
        raise ValueError(f"{tls_dir} already exists; remove it or choose another key directory")
    tls_dir.mkdir(parents=True, mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rlbus"), x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key, issuer: str, signer, extensions: list) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=VALID_DAYS)))
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert("rlbus metrics CA", ca_key, "rlbus metrics CA", ca_key, [
        (x509.BasicConstraints(ca=True, path_length=0), True),
        (x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                       key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                       decipher_only=False), True),
        (x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False),
    ])
    leaf_usage = x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False, content_commitment=False,
                               key_encipherment=False, data_encipherment=False, key_agreement=True,
                               encipher_only=False, decipher_only=False)
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    pem = serialization.Encoding.PEM
    created = [_write(tls_dir / "ca.crt", ca.public_bytes(pem), secret=False)]
    for role, cn, eku, sans in (
        ("server", SERVER_NAME, ExtendedKeyUsageOID.SERVER_AUTH,
         [x509.DNSName(SERVER_NAME), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        ("client", CLIENT_NAME, ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName(CLIENT_NAME)]),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = cert(cn, key, "rlbus metrics CA", ca_key, [
            (x509.BasicConstraints(ca=False, path_length=None), True), (leaf_usage, True),
            (x509.ExtendedKeyUsage([eku]), False), (x509.SubjectAlternativeName(sans), False), (aki, False),
        ])
        created.append(_write(tls_dir / f"{role}.crt", leaf.public_bytes(pem), secret=False))
        key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        created.append(_write(tls_dir / f"{role}.key", key_pem, secret=True))
    return created
