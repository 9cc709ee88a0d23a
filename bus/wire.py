"""The wire format: frame 0 a msgpack map ``{"type", "schema", "id", ...fields, "arrays": [{"name", "dtype",
"shape"}, ...]}``, frames 1..n the raw C-order bytes of each array, sent with ``copy=False`` and received as
buffers numpy views without copying. No pickle, no msgpack ext types, only :data:`ALLOWED_DTYPES`; every
frame is checked against the limits below before anything is allocated from it, and a bad message raises
:class:`WireError`. Message types declare fields with :func:`array_field` and :func:`optional_field`.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, NewType, Sequence

import msgpack
import numpy as np

SCHEMA_VERSION = 1  # a receiver rejects any other value (reason "schema")
ALLOWED_DTYPES = ("bool", "uint8", "int32", "int64", "float32", "float64")  # little-endian native
MAX_HEADER_BYTES = 4 << 20
MAX_ARRAYS = 64  # array frames per message
MAX_ARRAY_BYTES = 1 << 30
MAX_NDIM = 4

# Bounds handed to the msgpack unpacker so a hostile header cannot make it allocate much.
_UNPACK_LIMITS = dict(
    max_str_len=1 << 20,
    max_bin_len=1 << 20,
    max_array_len=1 << 20,
    max_map_len=1 << 16,
    max_ext_len=0,
)


def _no_ext(code: int, data: bytes) -> Any:
    # max_ext_len=0 still lets zero-length ext values through; refuse every ext type
    raise ValueError(f"msgpack ext type {code} is not allowed")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


def show(value: Any) -> str:
    """A repr of an untrusted value bounded in depth and length, for error messages."""
    return _REPR.repr(value)


class WireError(ValueError):
    """A received message violates the wire format; ``reason``, a short label, is the reject counter's."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class ArraySpec:
    """Declared dtype and rank of one array field."""

    dtype: str
    ndim: int


def array_field(dtype: str, ndim: int = 1, *, optional: bool = False) -> Any:
    """A field that travels as a raw array frame of ``dtype`` and rank ``ndim``; ``optional``: keyword-only,
    default an empty array (it still travels on every message)."""
    metadata = {"array": ArraySpec(dtype, ndim)}
    if not optional:
        return field(metadata=metadata)
    return field(metadata=metadata, kw_only=True, default_factory=lambda: np.zeros((0,) * ndim, dtype=dtype))


def optional_field(default: Any, *, may_be_absent: bool = False) -> Any:
    """A keyword-only header field with a default; ``may_be_absent``: a header without it decodes to the
    default (a field newer than some senders), else every message must carry it."""
    metadata = {"may_be_absent": True} if may_be_absent else {}
    if isinstance(default, (dict, list)):
        return field(kw_only=True, default_factory=lambda: type(default)(default), metadata=metadata)
    return field(kw_only=True, default=default, metadata=metadata)


ChatMessages = NewType("ChatMessages", list)  # a header field checked by is_chat_messages


def is_chat_messages(value: Any) -> bool:
    """Whether ``value`` is a list of ``{"role": str, "content": str}`` dicts with no other keys."""
    return isinstance(value, list) and all(
        isinstance(m, dict)
        and m.keys() == {"role", "content"}
        and isinstance(m["role"], str)
        and isinstance(m["content"], str)
        for m in value
    )


def check_terms(terms: dict, n: int) -> None:
    """Check ``reward_terms``: str keys, each a list of ``n`` finite numbers; else ``WireError("inconsistent")``."""
    for key, values in terms.items():
        if not isinstance(key, str) or not isinstance(values, list) or len(values) != n:
            raise WireError("inconsistent", f"reward_terms[{show(key)}] must be a list of {n} numbers")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in values):
            raise WireError("inconsistent", f"reward_terms[{show(key)}] must hold finite numbers")


def pack_header(header: dict[str, Any]) -> bytes:
    """The header map in msgpack; raises TypeError for a value msgpack cannot take (a numpy scalar)."""
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(buf: bytes | memoryview) -> dict[str, Any]:
    """Parse and bound-check a header frame.

    Raises:
        WireError: ``header`` (too large, not a msgpack map with a string ``type``) or ``schema``.
    """
    if len(buf) > MAX_HEADER_BYTES:
        raise WireError("header", f"header frame of {len(buf)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True, ext_hook=_no_ext, **_UNPACK_LIMITS)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise WireError("header", f"not a msgpack map: {type(exc).__name__}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise WireError("header", "header must be a map with a string 'type'")
    schema = header.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:  # not True, not 1.0
        raise WireError("schema", f"schema {show(header.get('schema'))} != {SCHEMA_VERSION}")
    return header


def array_descriptor(name: str, arr: np.ndarray) -> dict[str, Any]:
    """The ``arrays`` entry for one array: ``{"name", "dtype", "shape"}``."""
    return {"name": name, "dtype": arr.dtype.name, "shape": list(arr.shape)}


def decode_arrays(descriptors: Any, frames: Sequence[Any], specs: dict[str, ArraySpec]) -> dict[str, np.ndarray]:
    """One read-only array per declared field (``specs``), viewing frames 1..n, per the header's ``arrays``.

    Raises:
        WireError: ``frames`` (count or names differ), ``dtype``, ``shape`` or ``size``.
    """
    if not isinstance(descriptors, list) or len(descriptors) > MAX_ARRAYS:
        raise WireError("frames", "'arrays' must be a list of at most %d entries" % MAX_ARRAYS)
    if len(descriptors) != len(frames):
        raise WireError("frames", f"{len(descriptors)} arrays declared, {len(frames)} frames sent")
    out: dict[str, np.ndarray] = {}
    for desc, frame in zip(descriptors, frames):
        if not isinstance(desc, dict) or set(desc) != {"name", "dtype", "shape"}:
            raise WireError("frames", "array descriptor must be {name, dtype, shape}")
        name, dtype, shape = desc["name"], desc["dtype"], desc["shape"]
        spec = specs.get(name) if isinstance(name, str) else None
        if spec is None or name in out:
            raise WireError("frames", f"unexpected or repeated array {show(name)}")
        if dtype != spec.dtype or dtype not in ALLOWED_DTYPES:
            raise WireError("dtype", f"array {name!r} has dtype {show(dtype)}, expected {spec.dtype}")
        if (
            not isinstance(shape, list)
            or len(shape) != spec.ndim
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise WireError("shape", f"array {name!r} has shape {show(shape)}, expected rank {spec.ndim}")
        itemsize = np.dtype(dtype).itemsize
        expected = math.prod(shape) * itemsize
        buf = frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
        if expected > MAX_ARRAY_BYTES or buf.nbytes != expected:
            raise WireError("size", f"array {name!r}: {buf.nbytes} bytes for {dtype}{shape}")
        arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
        arr.flags.writeable = False  # zmq frames are writable; messages must not be mutated
        out[name] = arr
    if set(out) != set(specs):
        raise WireError("frames", f"missing arrays {sorted(set(specs) - set(out))}")
    return out
