"""CurveZMQ authentication of the tcp:// bus: the key directory, the launch-time check, the allow-list
authenticator, and the per-context settings that make every :class:`bus.sockets.BusSocket` of a context a
CURVE server (binds) or client (connects). The design, key layout and what is not covered are in
docs/ARCHITECTURE.md, "Authentication (tcp://)".
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

SERVER_NAME = "server"  # DIR/server.key(_secret): one keypair shared by every binder
CLIENTS_DIR = "clients"  # DIR/clients/*.key: the allow-list; *.key_secret: the client keypairs
DEFAULT_CLIENT = "components"  # the client keypair unless bus.curve_client names another


class CurveSettings(Protocol):
    """The fields of ``configs.schema.BusConfig`` read here."""

    transport: str
    curve_keys_dir: str
    curve_client: str


@dataclass(frozen=True)
class CurveKeys:
    """One process's keys (z85): the server keypair (for binding) and client keypair ``client``."""

    keys_dir: Path
    client: str
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @property
    def allow_dir(self) -> Path:
        """The allow-list directory (``*.key`` public keys)."""
        return self.keys_dir / CLIENTS_DIR

    @classmethod
    def load(cls, keys_dir: str | Path, client: str = DEFAULT_CLIENT) -> "CurveKeys":
        """Load the server keypair and client keypair ``client`` from ``keys_dir``.

        Raises:
            ValueError: a missing or unreadable directory or key file, or an empty allow-list (names the path).
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
    """Create a key directory (``busctl keys``): the server keypair, client keypairs :data:`DEFAULT_CLIENT`,
    ``client-1`` ... (``num_clients`` in all) and the metrics TLS files (:func:`telemetry.certs.create_tls`,
    one server certificate per host of ``hosts``); a directory with keys but no ``tls/`` gets the TLS files
    only. Directories 0700, secret files 0600. Returns the created files, server first, TLS last.

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
    """The launch-time check (``busctl up``, ``busctl sbatch``): a set ``bus.curve_keys_dir`` must load,
    with the metrics TLS files on tcp (checked with ipc too, where the keys go unused).

    Raises:
        ValueError: ``bus.curve_keys_dir: `` and :meth:`CurveKeys.load`'s or :meth:`MetricsTls.load`'s message.
    """
    if bus.curve_keys_dir:
        try:
            CurveKeys.load(bus.curve_keys_dir, bus.curve_client)
            if bus.transport == "tcp":
                MetricsTls.load(bus.curve_keys_dir)
        except ValueError as err:
            raise ValueError(f"bus.curve_keys_dir: {err}") from None


def keys_from_config(bus: CurveSettings) -> CurveKeys | None:
    """The CURVE keys a process uses, or None: no ``bus.curve_keys_dir``, or ipc:// (keys ignored, logged).

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
    """CURVE settings of one ``zmq.Context``. The first socket that binds starts the ZAP authenticator;
    :meth:`close` stops it and must run before ``ctx.term()`` (its sockets would keep ``term`` waiting)."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self.ctx = ctx
        self.keys = keys
        self.authenticator: ThreadAuthenticator | None = None
        self._lock = threading.Lock()

    def secure(self, sock: zmq.Socket, *, server: bool) -> None:
        """Make ``sock`` a CURVE server (will bind) or client (will connect); call before bind/connect."""
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
    """Attach CURVE settings to ``ctx`` for its :class:`bus.sockets.BusSocket` s; ``keys=None`` attaches none."""
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
