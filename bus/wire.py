"""The rlbus wire format: one msgpack header frame followed by raw array frames.

A message on any rlbus socket is a ZeroMQ multipart message::

    frame 0     msgpack map {"type": str, "schema": int, "id": str, ...fields,
                             "arrays": [{"name": str, "dtype": str, "shape": [int, ...]}, ...]}
    frame 1..n  the raw bytes of each array named in "arrays", in that order (C order)

Array frames are sent with ``copy=False`` and received as ``zmq.Frame`` buffers that numpy views
without copying (pyzmq's zero-copy threshold is 64 KiB; below it copying is cheaper anyway).

Invariants:
- No pickle and no code execution: the header is plain msgpack (no ext types), arrays are raw
  numeric buffers of an allowed dtype.
- Every received frame is validated against hard limits before anything is allocated from it;
  a bad message raises :class:`WireError` whose ``reason`` is a short label used as the
  ``reason`` of the ``rlbus_bus_rejected_total`` counter.

Message types (:mod:`bus.messages`) declare their array fields with :func:`array_field` (and
defaulted header fields with :func:`optional_field`); :mod:`bus.codec` turns a message into these
frames and back.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, NewType, Sequence

import msgpack
import numpy as np

SCHEMA_VERSION = 1
"""Wire schema version; a receiver rejects any other value (reason ``schema``)."""

ALLOWED_DTYPES = ("bool", "uint8", "int32", "int64", "float32", "float64")
"""The only array dtypes accepted on the bus (numpy names, little-endian native)."""

MAX_HEADER_BYTES = 4 << 20
"""Largest accepted header frame, bytes."""

MAX_ARRAYS = 64
"""Largest number of array frames in one message."""

MAX_ARRAY_BYTES = 1 << 30
"""Largest accepted array frame, bytes (1 GiB)."""

MAX_NDIM = 4
"""Largest accepted number of array dimensions."""

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
    """A short repr of an untrusted value for error messages (bounded depth and length, so a
    deeply nested or huge value cannot raise ``RecursionError`` or flood the log)."""
    return _REPR.repr(value)


class WireError(ValueError):
    """A received message violates the wire format.

    Attributes:
        reason: a short, bounded label (``"header"``, ``"schema"``, ``"unknown_type"``,
            ``"frames"``, ``"dtype"``, ``"shape"``, ``"size"``, ``"field"``, ``"inconsistent"``)
            used as the Prometheus label of the reject counter.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class ArraySpec:
    """Declared dtype and number of dimensions of one array field of a message type."""

    dtype: str
    ndim: int


def array_field(dtype: str, ndim: int = 1, *, optional: bool = False) -> Any:
    """Declare a dataclass field that travels as a raw array frame of ``dtype`` and rank ``ndim``.

    ``optional``: a keyword-only field that defaults to an empty array (shape ``[0] * ndim``), for
    data that only some runs carry (e.g. teacher logprobs); it still travels on every message.
    """
    metadata = {"array": ArraySpec(dtype, ndim)}
    if not optional:
        return field(metadata=metadata)
    return field(metadata=metadata, kw_only=True, default_factory=lambda: np.zeros((0,) * ndim, dtype=dtype))


def optional_field(default: Any, *, may_be_absent: bool = False) -> Any:
    """A keyword-only header field with a default (a copy of ``default`` for dicts and lists).

    ``may_be_absent``: a header without the field decodes to ``default`` (a field added after
    senders that do not know it were deployed); otherwise every message must carry it.
    """
    metadata = {"may_be_absent": True} if may_be_absent else {}
    if isinstance(default, (dict, list)):
        return field(kw_only=True, default_factory=lambda: type(default)(default), metadata=metadata)
    return field(kw_only=True, default=default, metadata=metadata)


ChatMessages = NewType("ChatMessages", list)
"""Type of a header field holding chat messages: a list of ``{"role": str, "content": str}`` maps,
exactly those two keys (:func:`is_chat_messages`); the decoder rejects anything else (``field``)."""


def is_chat_messages(value: Any) -> bool:
    """Whether ``value`` is a list of ``{"role": str, "content": str}`` dicts with no other keys
    (an empty list too). Used by the decoder for :data:`ChatMessages` fields, and by senders to
    decide whether a message list can travel as one."""
    return isinstance(value, list) and all(
        isinstance(m, dict)
        and m.keys() == {"role", "content"}
        and isinstance(m["role"], str)
        and isinstance(m["content"], str)
        for m in value
    )


def check_terms(terms: dict, n: int) -> None:
    """Validate a ``reward_terms`` mapping: str keys, each a list of ``n`` finite numbers.

    Raises:
        WireError: ``"inconsistent"``, naming the bad key.
    """
    for key, values in terms.items():
        if not isinstance(key, str) or not isinstance(values, list) or len(values) != n:
            raise WireError("inconsistent", f"reward_terms[{show(key)}] must be a list of {n} numbers")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v) for v in values):
            raise WireError("inconsistent", f"reward_terms[{show(key)}] must hold finite numbers")


def pack_header(header: dict[str, Any]) -> bytes:
    """Serialize a header map with msgpack (``use_bin_type=True``; no ext types).

    Raises:
        TypeError: a value is not msgpack-serializable (e.g. a numpy scalar or an object).
    """
    return msgpack.packb(header, use_bin_type=True)


def unpack_header(buf: bytes | memoryview) -> dict[str, Any]:
    """Parse and bound-check a header frame.

    Raises:
        WireError: ``header`` when the frame is too large, not msgpack, or not a map with a
            string ``type``; ``schema`` when ``schema`` differs from :data:`SCHEMA_VERSION`.
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
    """Turn the array frames of a message into numpy arrays, validating every one.

    Args:
        descriptors: the header's ``arrays`` list.
        frames: frames 1..n of the message (``zmq.Frame``, ``bytes`` or ``memoryview``).
        specs: the message type's declared arrays, by field name.

    Returns:
        One read-only array per declared field; arrays view the frame buffers (zero-copy).

    Raises:
        WireError: ``frames`` (count or names differ from the declaration), ``dtype``,
            ``shape`` (bad rank, negative or non-integer dims), ``size`` (frame bytes differ
            from dtype x shape, or exceed :data:`MAX_ARRAY_BYTES`).
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
