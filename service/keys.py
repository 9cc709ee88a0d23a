"""API keys of ``busctl serve`` (:mod:`configs.api_keys`: ``RLBUS_SERVE_API_KEYS`` and the lines of
``serve.api_keys_file``, sent as ``X-API-Key`` or ``Authorization: Bearer``); a missing or wrong key gets 401
and nothing else.
"""

from __future__ import annotations

from configs.api_keys import ENV_KEYS, key_ok, read_keys, request_key

__all__ = ["ENV_KEYS", "key_ok", "load_keys", "request_key"]


def load_keys(keys_file: str, environ: dict[str, str] | None = None) -> frozenset[str]:
    """The accepted keys. ValueError: none at all (the API never runs open), or a file that cannot be read."""
    keys = read_keys(keys_file, environ, what="serve.api_keys_file")
    if not keys:
        raise ValueError(f"busctl serve needs API keys: set {ENV_KEYS}=tml-... or serve.api_keys_file")
    return keys
