"""Byte bounds of the data topics' credit windows (``bus.max_inflight_bytes``), without the bus.

A data topic's credit window counts messages (``bus.topics.TopicSpec.hwm``: prompts 4, rollouts 8,
scored 8, batches 2, outcomes 64) and, from this setting, bytes: a receiver grants each sender at
most ``max_inflight_bytes`` of message frames waiting in its inbox, and a sender's outbox holds at
most that many bytes not yet taken by a consumer before ``send`` blocks. A message larger than the
bound still passes alone (when nothing else of that sender waits there), so no size is refused.
Memory per queue is then bounded by ``senders x max(max_inflight_bytes, largest message)`` whatever
the group size (``docs/DELIVERY.md``, "Credit").

The setting is one byte count for every data topic, or a mapping ``{topic: bytes}`` (topics not
named get :data:`DEFAULT_MAX_INFLIGHT_BYTES`). This module imports nothing of the bus:
:mod:`bus.topics` checks at import that :data:`DATA_TOPIC_NAMES` names exactly its data topics.
"""

from __future__ import annotations

from collections.abc import Mapping

DATA_TOPIC_NAMES: tuple[str, ...] = ("prompts", "scored", "batches", "outcomes", "rollouts")
"""The topics with at-least-once delivery and credit windows (``TopicSpec.reliable``)."""

DEFAULT_MAX_INFLIGHT_BYTES = 32 << 20
"""Default byte bound per sender of a credit window (32 MiB): two 16 MiB groups in flight per link,
far above what the message windows let through at ordinary group sizes (~0.04-2 MiB), so it only
binds for large groups."""

MAX_INFLIGHT_BYTES_LIMIT = 1 << 40
"""Largest bound accepted (1 TiB); the delivery envelope carries byte credit up to this."""

InflightBytes = int | Mapping[str, int]
"""What ``bus.max_inflight_bytes`` holds: one bound for every data topic, or one per topic."""


def check_inflight_bytes(setting: InflightBytes) -> None:
    """Validate a ``bus.max_inflight_bytes`` value.

    Raises:
        ValueError: a bound outside ``1 .. MAX_INFLIGHT_BYTES_LIMIT`` bytes or not an integer, or a
            key that is not a data topic (the message names the key and the data topics).
    """
    items = setting.items() if isinstance(setting, Mapping) else [("", setting)]
    for topic, value in items:
        where = f"bus.max_inflight_bytes.{topic}" if topic else "bus.max_inflight_bytes"
        if isinstance(setting, Mapping) and topic not in DATA_TOPIC_NAMES:
            raise ValueError(f"{where}: {topic!r} is not a data topic; data topics: {', '.join(DATA_TOPIC_NAMES)}")
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INFLIGHT_BYTES_LIMIT:
            raise ValueError(f"{where} must be a byte count from 1 to {MAX_INFLIGHT_BYTES_LIMIT}, got {value!r}")


def inflight_bytes_for(setting: InflightBytes | None, topic: str) -> int | None:
    """The byte bound of ``topic``'s credit windows under ``setting`` (None: no byte bound, the
    windows count messages only).

    Raises:
        ValueError: ``topic`` is not a data topic.
    """
    if topic not in DATA_TOPIC_NAMES:
        raise ValueError(f"{topic!r} is not a data topic; data topics: {', '.join(DATA_TOPIC_NAMES)}")
    if setting is None:
        return None
    if isinstance(setting, Mapping):
        return int(setting.get(topic, DEFAULT_MAX_INFLIGHT_BYTES))
    return int(setting)
