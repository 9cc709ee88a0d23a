"""API keys of rlbus's HTTP front doors (``busctl serve`` and the producers' OpenAI-compatible endpoints):
``RLBUS_SERVE_API_KEYS`` (comma-separated) plus the lines of a key file. A request carries its key as
``X-API-Key`` (the Tinker SDK) or ``Authorization: Bearer`` (xorl-client, OpenAI clients). Here, in a base
package, because both the service and the producers (stages, which import no stage) check keys.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path

ENV_KEYS = "RLBUS_SERVE_API_KEYS"
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


def read_keys(keys_file: str, environ: dict[str, str] | None = None, *, what: str = "api_keys_file") -> frozenset[str]:
    """``ENV_KEYS``' keys and the non-comment lines of ``keys_file`` (may be empty). ValueError: the file cannot
    be read (``what`` names its config key)."""
    env = os.environ if environ is None else environ
    keys = {k.strip() for k in env.get(ENV_KEYS, "").split(",") if k.strip()}
    if keys_file:
        try:
            text = Path(keys_file).read_text()
        except OSError as err:
            raise ValueError(f"{what} {keys_file}: {err}") from err
        keys |= {line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")}
    return frozenset(keys)


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` reaches this machine only (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_endpoint_keys(host: str, keys_file: str, environ: dict[str, str] | None = None) -> frozenset[str]:
    """The keys clients outside the run present to a producer endpoint bound at ``host`` (empty: loopback,
    no check). ValueError: beyond loopback with no key at all, or an unreadable ``keys_file``."""
    if is_loopback(host):
        return frozenset()
    keys = read_keys(keys_file, environ, what="producers.endpoint_api_keys_file")
    if not keys:
        raise ValueError(
            f"producers.endpoint_host={host} serves the OpenAI-compatible endpoint beyond loopback, which needs "
            f"API keys for its clients: set {ENV_KEYS}=KEY[,KEY...] or producers.endpoint_api_keys_file (the run's "
            "own agents get a key from their producer), or bind 127.0.0.1"
        )
    return keys


def request_key(headers: dict[str, str] | object) -> str:
    """The key a request presents (``X-API-Key``, else ``Authorization: Bearer KEY``), or ""."""
    get = headers.get  # type: ignore[attr-defined]
    key = get("x-api-key") or ""
    if not key:
        scheme, _, value = (get("authorization") or "").partition(" ")
        key = value.strip() if scheme.lower() == "bearer" else ""
    return key


def key_ok(key: str, keys: frozenset[str]) -> bool:
    """Whether ``key`` is one of ``keys`` (constant-time per comparison)."""
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(key.encode(), k.encode())
    return bool(key) and ok
