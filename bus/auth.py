"""CurveZMQ authentication of the tcp:// bus: keys, the allow-list authenticator, socket roles.

With ``bus.transport: tcp`` and a non-empty ``bus.curve_keys_dir``, every rlbus socket runs the
CURVE handshake: the side that binds is a CURVE *server*, the side that connects a CURVE
*client*. A ZAP authenticator (``zmq.auth.thread.ThreadAuthenticator``) in every process that
binds accepts only client public keys found in the allow-list directory, so a peer with an
unknown key, or without CURVE at all, never completes a handshake: it can neither send nor
receive a single message. Traffic of accepted peers is encrypted as well.

Key directory (made by ``busctl keys DIR``, the standard ``zmq.auth`` certificate files)::

    DIR/server.key, DIR/server.key_secret        one server keypair, shared by every binder
    DIR/clients/NAME.key                          allow-list: every public key here may connect
    DIR/clients/NAME.key_secret                   client keypair NAME (``bus.curve_client``)
    DIR/tls/                                      the metrics endpoints' CA and TLS certificates
                                                  (:mod:`telemetry.tls`; used with tcp)

How settings reach the sockets: :func:`enable` attaches a :class:`CurveAuth` to a process's
``zmq.Context`` (``Component`` and ``Supervisor`` do it from the config), and the one socket
factory, :class:`bus.sockets.BusSocket`, asks :func:`for_context` for the settings of the
context it creates a socket in. So every socket made from that context (data topics, the
control hub's XSUB/XPUB, the supervisor handshake) is secured without any component passing
keys around, much like zmq's own per-context default socket options.

When the key files are read: ``busctl up`` checks them at launch (:func:`check_keys`: a missing
file is a bad config, exit 2, before anything starts), and every process loads them again as it
opens its context (:func:`keys_from_config`). The config itself never reads them (``configs``
imports nothing of the bus).

Not covered: ipc:// is never CURVE-secured (the socket directory's file permissions guard it;
see :func:`keys_from_config`), the allow-list is read when a process first binds (a key added
or removed takes effect at the next restart of each binding process), and key distribution
is manual (copy the directory to every host).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from telemetry.certs import TLS_DIR, HostNames, create_tls
from telemetry.tls import MetricsTls

log = logging.getLogger(__name__)

SERVER_NAME = "server"
"""Basename of the server keypair in the key directory."""

CLIENTS_DIR = "clients"
"""Subdirectory holding the allow-list (``*.key``) and the client keypairs."""

DEFAULT_CLIENT = "components"
"""The client keypair every component uses unless ``bus.curve_client`` names another."""


class CurveSettings(Protocol):
    """The fields of the run's ``bus`` config section (``configs.schema.BusConfig``) that
    :func:`keys_from_config` and :func:`check_keys` read (a protocol: any object with them will do)."""

    transport: str
    curve_keys_dir: str
    curve_client: str


@dataclass(frozen=True)
class CurveKeys:
    """The key material of one process: the server keypair (for binding) and its client keypair.

    Attributes:
        keys_dir: the key directory (see the module docstring).
        client: name of the client keypair (``clients/CLIENT.key_secret``).
        server_public / server_secret / client_public / client_secret: z85-encoded keys.
    """

    keys_dir: Path
    client: str
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def allow_dir(self) -> Path:
        """Directory whose ``*.key`` public keys the authenticator accepts."""
        return self.keys_dir / CLIENTS_DIR

    @classmethod
    def load(cls, keys_dir: str | Path, client: str = DEFAULT_CLIENT) -> "CurveKeys":
        """Load the server keypair and client keypair ``client`` from ``keys_dir``.

        Raises:
            ValueError: the directory or a key file is missing or unreadable, or the allow-list
                is empty (the message names the path and how to make one).
        """
        keys_dir = Path(keys_dir)
        hint = "create one with `busctl keys DIR` (and copy it to every host)"
        if not keys_dir.is_dir():
            raise ValueError(f"CurveZMQ key directory {keys_dir} does not exist; {hint}")
        server_public, server_secret = _load_secret(keys_dir / f"{SERVER_NAME}.key_secret", hint)
        client_public, client_secret = _load_secret(keys_dir / CLIENTS_DIR / f"{client}.key_secret", hint)
        if not list((keys_dir / CLIENTS_DIR).glob("*.key")):
            raise ValueError(f"CurveZMQ allow-list {keys_dir / CLIENTS_DIR} holds no *.key public key; {hint}")
        return cls(keys_dir, client, server_public, server_secret, client_public, client_secret)


def _load_secret(path: Path, hint: str) -> tuple[bytes, bytes]:
    if not path.is_file():
        raise ValueError(f"CurveZMQ key file {path} does not exist; {hint}")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"CurveZMQ key file {path} is unreadable ({exc}); {hint}") from None
    if not secret:
        raise ValueError(f"CurveZMQ key file {path} holds no secret key; {hint}")
    return public, secret


def create_keys(keys_dir: str | Path, num_clients: int = 1, hosts: list[HostNames] | None = None) -> list[Path]:
    """Create a key directory: the server keypair, ``num_clients`` client keypairs and the metrics
    TLS files (:func:`telemetry.certs.create_tls`: one server certificate per host of ``hosts``,
    default this machine). A directory that holds CurveZMQ keys but no ``tls/`` (made before the
    metrics TLS existed) gets the TLS files only.

    The first client keypair is :data:`DEFAULT_CLIENT`, the others ``client-1`` ...
    ``client-{num_clients-1}`` (one per host, so that one host can be revoked alone). Directories
    are made mode 0700 and secret files 0600.

    Returns:
        The created files, in order (server first, the TLS files last).

    Raises:
        ValueError: ``num_clients < 1``, or ``keys_dir`` already holds keys and TLS files (never overwritten).
    """
    if num_clients < 1:
        raise ValueError(f"need at least one client keypair, got {num_clients}")
    keys_dir = Path(keys_dir)
    if (keys_dir / f"{SERVER_NAME}.key").exists() or (keys_dir / CLIENTS_DIR).exists():
        if (keys_dir / TLS_DIR).exists():
            raise ValueError(
                f"{keys_dir} already holds CurveZMQ keys and metrics TLS files; remove it or choose another directory"
            )
        return create_tls(keys_dir, hosts)
    clients = keys_dir / CLIENTS_DIR
    clients.mkdir(parents=True, mode=0o700)
    os.chmod(keys_dir, 0o700)
    created = [Path(p) for p in zmq.auth.create_certificates(keys_dir, SERVER_NAME)]
    for i in range(num_clients):
        created += [Path(p) for p in zmq.auth.create_certificates(clients, DEFAULT_CLIENT if i == 0 else f"client-{i}")]
    for path in created:
        if path.name.endswith(".key_secret"):
            os.chmod(path, 0o600)
    return created + create_tls(keys_dir, hosts)


def check_keys(bus: CurveSettings) -> None:
    """The launch-time check of ``bus.curve_keys_dir``: when it is set, its key files must load
    (:meth:`CurveKeys.load`; with tcp also the metrics TLS files, :meth:`telemetry.tls.MetricsTls.load`),
    with transport tcp or ipc (unused with ipc, but a config naming keys
    that are not there fails before the run). ``busctl up`` (``--dry-run`` too) and ``busctl sbatch``
    call it; the config does not, since ``configs`` imports nothing of the bus.

    Raises:
        ValueError: ``bus.curve_keys_dir: `` and the message of :meth:`CurveKeys.load` (names the
            missing or unreadable path and how to make keys).
    """
    if bus.curve_keys_dir:
        try:
            CurveKeys.load(bus.curve_keys_dir, bus.curve_client)
            if bus.transport == "tcp":
                MetricsTls.load(bus.curve_keys_dir)
        except ValueError as err:
            raise ValueError(f"bus.curve_keys_dir: {err}") from None


def keys_from_config(bus: CurveSettings) -> CurveKeys | None:
    """The CURVE keys a process uses (``bus``: the run's ``bus`` section), or None when the bus
    runs without authentication.

    CURVE is used only with ``bus.transport == "tcp"`` and a non-empty ``bus.curve_keys_dir``. With ipc://
    the keys are ignored (logged): only local processes reach an ipc socket, through the socket
    directory's file permissions, and CURVE would cost 2.5-3.7x throughput for nothing.

    Raises:
        ValueError: see :meth:`CurveKeys.load`.
    """
    if not bus.curve_keys_dir:
        return None
    if bus.transport != "tcp":
        log.warning("bus.curve_keys_dir is set but bus.transport is %s: CURVE applies to tcp:// only", bus.transport)
        return None
    return CurveKeys.load(bus.curve_keys_dir, bus.curve_client)


class CurveAuth:
    """CURVE settings of one ``zmq.Context``: makes its sockets CURVE servers or clients.

    The ZAP authenticator is started on the context by the first socket that binds (a process
    that only connects needs none) and stopped by :meth:`close`, which must run before
    ``ctx.term()`` (the authenticator's sockets would keep ``term`` waiting).

    Args:
        ctx: the process's context. keys: its key material.
    """

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self.ctx = ctx
        self.keys = keys
        self.authenticator: ThreadAuthenticator | None = None
        self._lock = threading.Lock()

    def secure(self, sock: zmq.Socket, *, server: bool) -> None:
        """Make ``sock`` a CURVE server (it will bind) or client (it will connect).

        Call before ``bind``/``connect``: the mechanism is fixed when a connection starts.
        """
        if server:
            self._ensure_authenticator()
            sock.curve_server = True
            sock.curve_secretkey = self.keys.server_secret
            sock.curve_publickey = self.keys.server_public
        else:
            sock.curve_serverkey = self.keys.server_public
            sock.curve_secretkey = self.keys.client_secret
            sock.curve_publickey = self.keys.client_public

    def _ensure_authenticator(self) -> None:
        # Started before the first bind: without a ZAP handler, libzmq lets any CURVE client in.
        with self._lock:
            if self.authenticator is not None:
                return
            authenticator = ThreadAuthenticator(self.ctx)
            authenticator.start()
            authenticator.configure_curve(domain="*", location=str(self.keys.allow_dir))
            allowed = len(authenticator.certs.get("*", {}))
            if not allowed:  # configure_curve only logs a bad location; refuse to run open-or-shut
                authenticator.stop()
                raise ValueError(f"CurveZMQ allow-list {self.keys.allow_dir} yielded no public key")
            self.authenticator = authenticator
            log.info("CurveZMQ authenticator started: %d allowed client key(s) from %s", allowed, self.keys.allow_dir)

    def close(self) -> None:
        """Stop the authenticator (idempotent)."""
        with self._lock:
            if self.authenticator is not None:
                self.authenticator.stop()
                self.authenticator = None


_BY_CONTEXT: "weakref.WeakKeyDictionary[zmq.Context, CurveAuth]" = weakref.WeakKeyDictionary()


def enable(ctx: zmq.Context, keys: CurveKeys | None) -> CurveAuth | None:
    """Attach CURVE settings to ``ctx``: every :class:`bus.sockets.BusSocket` made from it uses
    them. ``keys=None`` (no authentication) attaches nothing and returns None."""
    if keys is None:
        return None
    assert ctx not in _BY_CONTEXT, "CURVE is already enabled on this context"
    curve = _BY_CONTEXT[ctx] = CurveAuth(ctx, keys)
    return curve


def for_context(ctx: zmq.Context) -> CurveAuth | None:
    """The CURVE settings attached to ``ctx``, or None (plaintext)."""
    return _BY_CONTEXT.get(ctx)


def disable(ctx: zmq.Context) -> None:
    """Stop ``ctx``'s authenticator and detach its settings; call before ``ctx.term()``."""
    curve = _BY_CONTEXT.pop(ctx, None)
    if curve is not None:
        curve.close()
