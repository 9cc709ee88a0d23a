"""The names of the bus's topics, without the bus: what the keys of ``bus.hosts`` may be.

``configs`` is the lowest floor and imports no transport, so the names live here and
:mod:`bus.topics`, which holds the whole table (socket types, bounds, port offsets), imports
them and checks at import that its table names exactly these topics.
"""

from __future__ import annotations

TOPIC_NAMES: tuple[str, ...] = (
    "prompts",
    "scored",
    "batches",
    "outcomes",
    "control_pub",
    "control_sub",
    "supervisor",
    "weights",
    "rollouts",
    "api",
    "samplers",
)
"""Every topic of :data:`bus.topics.TOPICS`, in its order."""


def endpoint_key_ok(key: str) -> bool:
    """Whether ``key`` may appear in ``bus.hosts``: a topic name, or ``rollouts-I`` (I >= 0)."""
    base, _, index = key.rpartition("-")
    return (key in TOPIC_NAMES and key != "rollouts") or (base == "rollouts" and index.isdigit())
