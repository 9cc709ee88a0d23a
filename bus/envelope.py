"""The delivery envelope of the data topics (protocol: ``docs/DELIVERY.md``) and what a box hands
its courier to transmit.

Every frame set of the delivery protocol starts with a msgpack list
``[PROTOCOL, kind, session, payload]``:

| kind | from -> to | payload | frames after |
|---|---|---|---|
| ``D`` | sender -> receiver | message id (str) | the message (:mod:`bus.messages` frames) |
| ``A`` | receiver -> sender | ``[free, taken_ids, done_ids]`` or ``[free, taken_ids, done_ids, free_bytes, empty]`` (also its heartbeat) | |
| ``H`` | sender -> receiver | None (heartbeat) | |
| ``B`` | receiver -> sender | None (leaving: re-send what I hold) | |

``session`` is a random id per :class:`bus.courier.Courier`: a peer whose session changes has
restarted. ``free`` is the receiver's credit in messages; the two optional fields are its byte
credit (``bus.max_inflight_bytes`` less the bytes of the sender's messages waiting in its inbox)
and whether none of them waits there (then one message of any size may come: a message larger
than the byte window passes alone); a receiver without a byte bound sends the short form.
Invariants: :func:`parse_envelope` only returns envelopes that satisfy this table (ids are
non-empty strings of at most :data:`MAX_ID_CHARS`, at most :data:`MAX_IDS_PER_ACK` per list,
credit in ``0..1_000_000`` messages and ``0..MAX_CREDIT_BYTES`` bytes, ``empty`` a bool); anything
else raises :class:`bus.wire.WireError`. Pure: no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from bus.wire import WireError
from configs.bus_limits import MAX_INFLIGHT_BYTES_LIMIT

PROTOCOL = 1
"""Version of the delivery protocol (first element of every envelope)."""

MAX_ENVELOPE_BYTES = 1 << 20
MAX_IDS_PER_ACK = 4096
MAX_ID_CHARS = 256
MAX_CREDIT_BYTES = MAX_INFLIGHT_BYTES_LIMIT
"""Largest byte credit an ack may carry: the largest ``bus.max_inflight_bytes`` a config accepts."""

_UNPACK_LIMITS = dict(
    raw=False,
    max_str_len=MAX_ID_CHARS,
    max_bin_len=0,
    max_array_len=MAX_IDS_PER_ACK,
    max_map_len=0,
    max_ext_len=0,
)

PeerKey = tuple[int, bytes]
"""(link number, ZeroMQ routing id); the routing id is ``b""`` on a DEALER link (one peer)."""


@dataclass
class Send:
    """One frame set a box asks its courier to transmit to peer ``key``.

    The box has already updated its state as if it went out; when it cannot go out now the courier
    hands it back with ``unsent`` so the box can undo that.

    Attributes:
        key: the peer. frames: the envelope, then (``D`` only) the message frames.
        msg_id: ``D`` only: the message carried. nbytes: ``D`` only: bytes of the message frames.
        first: ``D`` only: the first time this message goes to this peer.
        done: ``A`` only: the ids it releases (kept for the next ack if it cannot go out).
    """

    key: PeerKey
    frames: list[Any]
    msg_id: str | None = None
    nbytes: int = 0
    first: bool = False
    done: list[str] = field(default_factory=list)


def envelope(kind: str, session: str, payload: Any) -> bytes:
    """The envelope ``[PROTOCOL, kind, session, payload]`` in msgpack (kinds: the table above)."""
    return msgpack.packb([PROTOCOL, kind, session, payload])


def _count_ok(value: Any, most: int) -> bool:
    """``value`` is an int (not a bool) in ``0..most``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most


def parse_envelope(raw: bytes) -> tuple[str, str, Any]:
    """Returns ``(kind, session, payload)`` of an envelope.

    Raises:
        WireError: ``too_large`` (over :data:`MAX_ENVELOPE_BYTES`) or ``envelope`` (undecodable,
            or not what the table above says).
    """
    if len(raw) > MAX_ENVELOPE_BYTES:
        raise WireError("too_large", "delivery envelope too large")
    try:
        env = msgpack.unpackb(raw, **_UNPACK_LIMITS)
    except Exception as exc:
        raise WireError("envelope", f"undecodable delivery envelope: {type(exc).__name__}") from None
    if not (isinstance(env, list) and len(env) == 4 and env[0] == PROTOCOL and env[1] in ("D", "A", "H", "B")):
        raise WireError("envelope", "delivery envelope must be [1, kind, session, payload]")
    _, kind, session, payload = env
    if not isinstance(session, str) or not session:
        raise WireError("envelope", "delivery envelope needs a session string")
    if kind == "D" and not (isinstance(payload, str) and payload):
        raise WireError("envelope", "data envelope needs a message id")
    if kind == "A":
        ok = (
            isinstance(payload, list)
            and len(payload) in (3, 5)
            and _count_ok(payload[0], 1_000_000)
            and all(isinstance(ids, list) and all(isinstance(i, str) for i in ids) for ids in payload[1:3])
            and (len(payload) == 3 or (_count_ok(payload[3], MAX_CREDIT_BYTES) and isinstance(payload[4], bool)))
        )
        if not ok:
            raise WireError(
                "envelope",
                "ack envelope must be [free, taken_ids, done_ids] or [free, taken_ids, done_ids, free_bytes, empty]",
            )
    return kind, session, payload
