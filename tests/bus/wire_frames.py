"""Wire frames of a message with its header changed: what a sender of another schema version (or a
hostile one) puts on the wire, and the plain frames a raw test peer sends. Shared by the bus tests
(the decoder's rejects, older senders, the raw delivery peer) and the TRL reward tests that send a
group over ZeroMQ."""

from __future__ import annotations

from typing import Any, Callable

import msgpack

from bus.codec import encode
from bus.messages import Message


def frames_of(msg: Message) -> list[bytes]:
    """``msg`` encoded as plain ``bytes`` frames (:func:`bus.codec.encode`): ``[header, *arrays]``."""
    return [bytes(memoryview(f)) for f in encode(msg)]


def edited_frames(msg: Message, edit: Callable[[dict[str, Any]], Any]) -> list[bytes]:
    """:func:`frames_of` of ``msg`` with its header decoded, changed in place by ``edit`` (its
    return value is ignored, so ``lambda header: header.pop("field")`` leaves a field out) and re-packed
    as the encoder packs it (msgpack, ``use_bin_type``); the array frames unchanged."""
    frames = frames_of(msg)
    header = msgpack.unpackb(frames[0])
    edit(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]
