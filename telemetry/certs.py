"""Making the metrics TLS files (``busctl keys DIR [--hosts SPEC]``, :func:`create_tls`): ``DIR/tls/ca.crt``
(the CA; its private key is discarded, so the hosts are fixed when the directory is made),
``hosts/NAME.crt`` + ``.key`` per host and ``client.crt`` + ``.key``. Every server certificate names
exactly one host, so a stolen key serves as that host only. ECDSA P-256 keys (``cryptography``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path

TLS_DIR = "tls"  # under the key directory
HOSTS_DIR = "hosts"  # under TLS_DIR: one server certificate per host
CLIENT_NAME = "rlbus-scraper"  # CN of the scrapers' client certificate
CA_NAME = "rlbus metrics CA"
VALID_DAYS = 825  # of every certificate: the longest browsers accept for a server

_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")  # a DNS host name (RFC 1123)


def _check_name(name: str, where: str) -> str:
    """``name`` if it is an IP address or a DNS host name, else ValueError naming ``where``."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    if len(name) > 253 or not _NAME.match(name) or re.fullmatch(r"[0-9.]+", name):  # digits only: a bad address
        raise ValueError(f"{where}: {name!r} is neither an IP address nor a host name (letters, digits, '-', '.')")
    return name.lower()


@dataclass(frozen=True)
class HostNames:
    """The names one host's metrics server is reached by (its certificate's subjectAltName): ``name`` (also
    the file stem and CN) and ``aliases``, more names and IP addresses."""

    name: str
    aliases: tuple[str, ...] = ()

    @property
    def all(self) -> tuple[str, ...]:
        """``name`` then ``aliases``, without repeats."""
        return tuple(dict.fromkeys((self.name, *self.aliases)))

    def with_addresses(self) -> "HostNames":
        """These names plus the addresses each resolves to here: readers connect at the address a launcher
        gave (Slurm resolves node names, Ray reports IPs)."""
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
    """This machine: its host name (no DNS lookup), ``localhost``, ``127.0.0.1``, ``::1``."""
    here = socket.gethostname()
    try:
        here = _check_name(here, "this machine's host name")
    except ValueError:
        here = "localhost"
    return [HostNames(here, tuple(n for n in ("localhost", "127.0.0.1", "::1") if n != here))]


def parse_hosts(spec: str) -> list[HostNames]:
    """The hosts of ``busctl keys --hosts SPEC``: ``NAME`` or ``NAME=ALIAS+ALIAS...``, comma-separated (e.g.
    ``node1=10.0.0.1,node2=10.0.0.2+node2.example``).

    Raises:
        ValueError: an empty list or host, a bad name or address, a host given twice (names it).
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
    """Create ``keys_dir/tls`` (0700, keys 0600): the CA, one server certificate per host (default
    :func:`default_hosts`; subjectAltName per RFC 5280 4.2.1.6) and the client's; returns the files made.

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
    """The subjectAltName DNS names and IP addresses of the PEM certificate at ``path``.

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
    """One host per address of ``nodes`` (node name -> its launcher's address), named after the node when
    that is a host name, the address in its subjectAltName.

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
