"""Making the metrics TLS certificates: the run's CA, one server certificate per host, the client's.

``busctl keys DIR [--hosts SPEC]`` calls :func:`create_tls` (through :func:`bus.auth.create_keys`);
:mod:`telemetry.tls` loads what it writes and chooses among it. Layout::

    DIR/tls/ca.crt                       the run's CA (self-signed); its private key is discarded
    DIR/tls/hosts/NAME.crt, NAME.key     one server certificate per host, its subjectAltName the
                                         host's names and addresses (:class:`HostNames`)
    DIR/tls/client.crt, client.key       the scrapers' client certificate (CN ``rlbus-scraper``)

Invariant: every server certificate names exactly one host, so a host's stolen key serves as that
host only; readers check the name they connect to against it (``ssl`` ``check_hostname``).
Because the CA's private key is discarded, the set of hosts is fixed when the directory is made: a
new host needs a new directory. Keys are ECDSA P-256 (``cryptography``), certificates valid
:data:`VALID_DAYS` days.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

TLS_DIR = "tls"
"""Subdirectory of the key directory holding the certificates."""

HOSTS_DIR = "hosts"
"""Subdirectory of :data:`TLS_DIR` holding one server certificate per host."""

CLIENT_NAME = "rlbus-scraper"
"""Common name of the scrapers' client certificate."""

CA_NAME = "rlbus metrics CA"
"""Common name of the run's CA."""

VALID_DAYS = 825
"""Validity of the CA, server and client certificates, days (825: the longest browsers accept for a server)."""

_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
"""A DNS host name (letters, digits, ``-``, ``.``; RFC 1123), checked when it is not an address."""


def _check_name(name: str, where: str) -> str:
    """``name`` if it is an IP address or a DNS host name.

    Raises:
        ValueError: anything else (names ``where`` it was given).
    """
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    if len(name) > 253 or not _NAME.match(name) or re.fullmatch(r"[0-9.]+", name):  # digits only: a bad address
        raise ValueError(f"{where}: {name!r} is neither an IP address nor a host name (letters, digits, '-', '.')")
    return name.lower()


@dataclass(frozen=True)
class HostNames:
    """The names one host's metrics server is reached by: its certificate's subjectAltName.

    Attributes:
        name: the host's name, also the certificate's file stem (``hosts/NAME.crt``) and CN.
        aliases: more names and IP addresses of the same host (the first of all is ``name``).
    """

    name: str
    aliases: tuple[str, ...] = ()

    @property
    def all(self) -> tuple[str, ...]:
        """``name`` then ``aliases``, without repeats."""
        return tuple(dict.fromkeys((self.name, *self.aliases)))

    def with_addresses(self) -> "HostNames":
        """These names plus the addresses each DNS name resolves to here (``socket.getaddrinfo``):
        readers connect to a component at the address its launcher gave it (Slurm resolves node
        names, Ray reports node IPs), so the certificate must name that address. A name that does
        not resolve is kept alone."""
        found: list[str] = []
        for n in self.all:
            if _is_address(n):
                continue
            try:
                found += [str(ipaddress.ip_address(info[4][0].split("%")[0])) for info in socket.getaddrinfo(n, None)]
            except (OSError, ValueError):
                continue
        return HostNames(self.name, tuple(dict.fromkeys((*self.aliases, *found))))


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def default_hosts() -> list[HostNames]:
    """This machine alone: its host name (``socket.gethostname``; no DNS lookup), with ``localhost``,
    ``127.0.0.1`` and ``::1`` (what a local run's readers connect to: 127.0.0.1)."""
    here = socket.gethostname()
    try:
        here = _check_name(here, "this machine's host name")
    except ValueError:
        here = "localhost"
    return [HostNames(here, tuple(n for n in ("localhost", "127.0.0.1", "::1") if n != here))]


def parse_hosts(spec: str) -> list[HostNames]:
    """The hosts of ``busctl keys --hosts SPEC``: comma-separated hosts, each ``NAME`` or
    ``NAME=ALIAS+ALIAS...`` (aliases: more names or IP addresses of the same host), e.g.
    ``node1=10.0.0.1,node2=10.0.0.2+node2.example``.

    Raises:
        ValueError: an empty list or host, a name that is neither a host name nor an IP address,
            or a host given twice (the message names it).
    """
    hosts: list[HostNames] = []
    for i, item in enumerate(spec.split(",")):
        where = f"--hosts item {i + 1} ({item.strip()!r})"
        name, _, rest = item.strip().partition("=")
        if not name:
            raise ValueError(f"{where}: empty host; give NAME or NAME=ALIAS+ALIAS, hosts separated by ','")
        aliases = tuple(_check_name(a.strip(), where) for a in rest.split("+")) if rest else ()
        host = HostNames(_check_name(name.strip(), where), aliases)
        if any(host.name == h.name for h in hosts):
            raise ValueError(f"{where}: host {host.name} given twice")
        hosts.append(host)
    if not hosts:
        raise ValueError("--hosts: no host given")
    return hosts


def _write(path: Path, data: bytes, secret: bool) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def create_tls(keys_dir: str | Path, hosts: list[HostNames] | None = None) -> list[Path]:
    """Create ``keys_dir/tls`` (mode 0700): a CA, one server certificate per host of ``hosts``
    (default :func:`default_hosts`; each host's subjectAltName holds its names and addresses,
    DNS names and IP addresses as such, RFC 5280 4.2.1.6) and the client certificate. Private keys
    are written 0600 and the CA's private key is discarded.

    Returns:
        The created files: ``ca.crt``, then ``hosts/NAME.crt``, ``hosts/NAME.key`` per host, then
        ``client.crt``, ``client.key``.

    Raises:
        ValueError: ``keys_dir/tls`` already exists (never overwritten), or two hosts share a name.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    hosts = default_hosts() if hosts is None else hosts
    if len({h.name for h in hosts}) != len(hosts) or not hosts:
        raise ValueError(f"need one or more hosts with distinct names, got {[h.name for h in hosts]}")
    tls_dir = Path(keys_dir) / TLS_DIR
    if tls_dir.exists():
        raise ValueError(f"{tls_dir} already exists; remove it or choose another key directory")
    tls_dir.mkdir(parents=True, mode=0o700)
    (tls_dir / HOSTS_DIR).mkdir(mode=0o700)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name(
            [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "rlbus"), x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        )

    def cert(subject: str, key, signer, extensions: list) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(name(CA_NAME))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        )
        for ext, critical in extensions:
            builder = builder.add_extension(ext, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    def san(n: str) -> x509.GeneralName:
        return x509.IPAddress(ipaddress.ip_address(n)) if _is_address(n) else x509.DNSName(n)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = cert(
        CA_NAME,
        ca_key,
        ca_key,
        [
            (x509.BasicConstraints(ca=True, path_length=0), True),
            (
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                True,
            ),
            (x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False),
        ],
    )
    leaf_usage = x509.KeyUsage(
        digital_signature=True,
        key_cert_sign=False,
        crl_sign=False,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=True,
        encipher_only=False,
        decipher_only=False,
    )
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())
    pem = serialization.Encoding.PEM
    created = [_write(tls_dir / "ca.crt", ca.public_bytes(pem), secret=False)]
    leaves = [
        (f"{HOSTS_DIR}/{h.name}", h.name, ExtendedKeyUsageOID.SERVER_AUTH, [san(n) for n in h.all]) for h in hosts
    ]
    for stem, cn, eku, sans in [
        *leaves,
        ("client", CLIENT_NAME, ExtendedKeyUsageOID.CLIENT_AUTH, [x509.DNSName(CLIENT_NAME)]),
    ]:
        key = ec.generate_private_key(ec.SECP256R1())
        leaf = cert(
            cn,
            key,
            ca_key,
            [
                (x509.BasicConstraints(ca=False, path_length=None), True),
                (leaf_usage, True),
                (x509.ExtendedKeyUsage([eku]), False),
                (x509.SubjectAlternativeName(sans), False),
                (aki, False),
            ],
        )
        created.append(_write(tls_dir / f"{stem}.crt", leaf.public_bytes(pem), secret=False))
        key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        created.append(_write(tls_dir / f"{stem}.key", key_pem, secret=True))
    return created


def certificate_names(path: str | Path) -> tuple[str, ...]:
    """The DNS names and IP addresses (as text) of the subjectAltName of the PEM certificate at ``path``.

    Raises:
        OSError: the file does not read. ValueError: it is not a PEM certificate.
    """
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return (
        *(n.lower() for n in sans.get_values_for_type(x509.DNSName)),
        *(str(a) for a in sans.get_values_for_type(x509.IPAddress)),
    )


def node_hosts(nodes: dict[str, str]) -> list[HostNames]:
    """One host per node of a multi-node launch (``nodes``: node name -> the address its launcher
    gives its components): named after the node when that is a host name (else its address), the
    address always in the subjectAltName. Nodes sharing one address become one host.

    Raises:
        ValueError: an address that is not an IP address or host name (names it).
    """
    hosts: dict[str, HostNames] = {}
    for node, address in nodes.items():
        address = _check_name(address, f"address {address!r} of node {node!r}")
        try:
            name = _check_name(node, "node")
        except ValueError:
            name = address
        if address not in hosts:
            hosts[address] = HostNames(name if all(h.name != name for h in hosts.values()) else address, (address,))
    return list(hosts.values())
