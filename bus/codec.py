"""Encode a message (:mod:`bus.messages`) to :mod:`bus.wire` frames and decode it back (exact round trip;
decoded arrays view the received buffers). Only registered types (:data:`bus.registry.MESSAGE_TYPES`) pass;
``decode`` validates every field and the type's ``check()`` and raises :class:`bus.wire.WireError` on
anything else, so a decoded message is well-formed. A missing header field is an error unless declared
``optional_field(..., may_be_absent=True)`` (then its default).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Any

import numpy as np

from bus.messages import Message
from bus.registry import MESSAGE_TYPES
from bus.wire import (
    SCHEMA_VERSION,
    ChatMessages,
    WireError,
    array_descriptor,
    decode_arrays,
    is_chat_messages,
    pack_header,
    show,
    unpack_header,
)

_SCALAR_CHECKS: dict[Any, Any] = {
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    str: lambda v: isinstance(v, str),
    bool: lambda v: isinstance(v, bool),
    dict: lambda v: isinstance(v, dict),
    list: lambda v: isinstance(v, list),
    list[str]: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    dict[str, float]: lambda v: (
        isinstance(v, dict)
        and all(isinstance(k, str) and isinstance(x, (int, float)) and not isinstance(x, bool) for k, x in v.items())
    ),
    ChatMessages: is_chat_messages,
}


@functools.cache  # resolving the type hints costs ~0.2 ms: once per class, not per message
def _scalar_fields(cls: type[Message]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if "array" not in f.metadata}


@functools.cache
def _may_be_absent(cls: type[Message]) -> frozenset[str]:
    """Header fields of ``cls`` that an older sender may leave out (``optional_field(may_be_absent=True)``)."""
    return frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get("may_be_absent"))


def encode(msg: Message) -> list[Any]:
    """Encode a message to frames ``[header, *array buffers]`` (arrays made C-contiguous).

    Raises:
        TypeError: ``msg`` is not a registered message type, or an array has the wrong dtype.
    """
    cls = type(msg)
    if MESSAGE_TYPES.get(cls.TYPE) is not cls:
        raise TypeError(f"{cls.__name__} is not a registered message type")
    header: dict[str, Any] = {"type": cls.TYPE, "schema": SCHEMA_VERSION}
    header.update({name: getattr(msg, name) for name in _scalar_fields(cls)})
    frames: list[Any] = []
    descriptors = []
    for name, spec in cls.array_specs().items():
        arr = np.ascontiguousarray(getattr(msg, name))
        if not arr.dtype.isnative:  # dtype.name ignores byte order: '>i4' is also "int32"
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if arr.dtype.name != spec.dtype or arr.ndim != spec.ndim:
            raise TypeError(
                f"{cls.__name__}.{name} must be {spec.dtype} of rank {spec.ndim}, got {arr.dtype}{arr.shape}"
            )
        descriptors.append(array_descriptor(name, arr))
        frames.append(arr.data)
    header["arrays"] = descriptors
    return [pack_header(header), *frames]


def decode(frames: list[Any]) -> Message:
    """Decode and validate ``[header, *array frames]`` (``zmq.Frame``, bytes or memoryview) into a message.

    Raises:
        WireError: the message is malformed; ``reason`` says how.
    """
    if not frames:
        raise WireError("frames", "empty message")
    head = frames[0]
    header = unpack_header(head.buffer if hasattr(head, "buffer") else head)
    cls = MESSAGE_TYPES.get(header["type"])
    if cls is None:
        raise WireError("unknown_type", f"unknown message type {show(header['type'])}")
    values: dict[str, Any] = {}
    absent_ok = _may_be_absent(cls)
    for name, hint in _scalar_fields(cls).items():
        if name not in header and name in absent_ok:
            continue  # an older sender's message: the field's default
        if name not in header or not _SCALAR_CHECKS[hint](header[name]):
            raise WireError("field", f"{cls.TYPE}.{name} missing or not {hint}")
        values[name] = header[name]
    values.update(decode_arrays(header.get("arrays"), frames[1:], cls.array_specs()))
    msg = cls(**values)
    msg.check()
    return msg
