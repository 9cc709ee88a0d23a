"""API keys of ``busctl serve``: ``RLBUS_SERVE_API_KEYS`` (comma-separated) and the lines of
``serve.api_keys_file``. A request carries its key as ``X-API-Key`` (the Tinker SDK) or ``Authorization:
Bearer`` (xorl-client, OpenAI clients); a missing or wrong key gets 401 and nothing else.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

ENV_KEYS = "RLBUS_SERVE_API_KEYS"


def load_keys(keys_file: str, environ: dict[str, str] | None = None) -> frozenset[str]:
    """The accepted keys. ValueError: none at all (the API never runs open), or a file that cannot be read."""
    env = os.environ if environ is None else environ
    keys = {k.strip() for k in env.get(ENV_KEYS, "").split(",") if k.strip()}
    if keys_file:
        try:
            text = Path(keys_file).read_text()
        except OSError as err:
            raise ValueError(f"serve.api_keys_file {keys_file}: {err}") from err
        keys |= {line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")}
    if not keys:
        raise ValueError(f"busctl serve needs API keys: set {ENV_KEYS}=tml-... or serve.api_keys_file")
    return frozenset(keys)


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
