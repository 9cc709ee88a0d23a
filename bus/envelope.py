"""The delivery envelope of the data topics (docs/DELIVERY.md) and :class:`Send`, what a box hands its courier.

Every frame set starts with msgpack ``[PROTOCOL, kind, session, payload]``: ``D`` data (the message id, then
the message frames), ``A`` a receiver's ack and heartbeat (``[free, taken_ids, done_ids]``, plus ``free_bytes,
empty`` under a byte bound), ``H`` a sender's heartbeat, ``B`` a receiver's goodbye. ``session`` is random per
courier: a new one means the peer restarted. :func:`parse_envelope` returns only that shape within the
bounds below, else raises :class:`bus.wire.WireError`. Pure: no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from bus.wire import WireError
from configs.bus_limits import MAX_INFLIGHT_BYTES_LIMIT

PROTOCOL = 1  # version of the delivery protocol

MAX_ENVELOPE_BYTES = 1 << 20
MAX_IDS_PER_ACK = 4096
MAX_ID_CHARS = 256
MAX_CREDIT_BYTES = MAX_INFLIGHT_BYTES_LIMIT  # the largest bus.max_inflight_bytes a config accepts

_UNPACK_LIMITS = dict(
    raw=False,
    max_str_len=MAX_ID_CHARS,
    max_bin_len=0,
    max_array_len=MAX_IDS_PER_ACK,
    max_map_len=0,
    max_ext_len=0,
)

PeerKey = tuple[int, bytes]  # (link number, ZeroMQ routing id; b"" on a DEALER link)


@dataclass
class Send:
    """One frame set for peer ``key``; the box already counts it sent and undoes that on ``unsent``.
    ``D`` only: ``msg_id``, ``nbytes`` (message frames), ``first`` (first time to this peer); ``A`` only:
    ``done``, the ids it releases (kept for the next ack if it cannot go out)."""

    key: PeerKey
    frames: list[Any]
    msg_id: str | None = None
    nbytes: int = 0
    first: bool = False
    done: list[str] = field(default_factory=list)


def envelope(kind: str, session: str, payload: Any) -> bytes:
    """The envelope ``[PROTOCOL, kind, session, payload]`` in msgpack."""
    return msgpack.packb([PROTOCOL, kind, session, payload])


def _count_ok(value: Any, most: int) -> bool:
    """``value`` is an int (not a bool) in ``0..most``."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= most


def parse_envelope(raw: bytes) -> tuple[str, str, Any]:
    """``(kind, session, payload)`` of an envelope.

    Raises:
        WireError: ``too_large`` (over :data:`MAX_ENVELOPE_BYTES`) or ``envelope`` (any other fault).
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
