"""The producers' applied policy versions as the prompt source's gate sees them.

The gate's ``policy_version`` is the version every live producer runs: the minimum over the
producers' ``weights.applied`` announcements. Producers come and go (restarts, ``busctl scale``),
so the gate (:class:`AppliedVersions`) follows these rules:

- the newest announcement of a producer wins, also when it is *lower* (a trainer that resumed
  from its checkpoint announces an older version; the gate follows it down);
- until the ``num_producers`` initial producers have each announced once the version is 0, unless
  ``dead_after_s`` has passed since the first announcement (an initial producer that died before
  announcing must not hold the gate forever);
- a producer is *departed*, and ignored, once another producer announced a version different from
  its own more than ``dead_after_s`` ago and it has not caught up since: a live producer applies a
  broadcast within seconds of the others, a dead or removed one never does. It counts again as
  soon as it announces (a restarted producer with the same name, which re-applies the weights).
"""

from __future__ import annotations

from typing import Any


class AppliedVersions:
    """The producers' applied policy versions, and the version the gate may rely on.

    Args:
        num_producers: producers started with the run (the gate waits for each once).
        dead_after_s: how long a producer may stay behind an announcement before it is ignored,
            seconds (``bus.dead_after_s``).

    Times are ``clock()`` seconds (monotonic) passed by the caller. Rules: module docstring.
    """

    def __init__(self, num_producers: int, dead_after_s: float) -> None:
        if num_producers < 1 or dead_after_s <= 0:
            raise ValueError(f"num_producers must be >= 1 and dead_after_s > 0, got {num_producers}, {dead_after_s}")
        self.num_producers = num_producers
        self.dead_after_s = dead_after_s
        self.version: dict[str, int] = {}  # producer -> its newest announced version
        self.behind_since: dict[str, float] = {}  # producer -> when another announced a different version
        self.first_announcement: float | None = None

    def announce(self, producer: str, version: int, now: float) -> None:
        """``producer`` now runs ``version`` (its newest announcement wins, lower or not)."""
        if self.first_announcement is None:
            self.first_announcement = now
        self.version[producer] = version
        self.behind_since.pop(producer, None)
        for other, v in self.version.items():
            if v == version:
                self.behind_since.pop(other, None)  # agrees with the newest announcement
            else:
                self.behind_since.setdefault(other, now)

    def departed(self, now: float) -> list[str]:
        """Producers ignored at ``now``: behind an announcement for more than ``dead_after_s``."""
        return sorted(p for p, t in self.behind_since.items() if now - t > self.dead_after_s)

    def policy_version(self, now: float) -> int:
        """The version every live producer runs: min over non-departed producers (0 while the
        initial producers have not all announced and ``dead_after_s`` has not passed)."""
        if not self.version:
            return 0
        assert self.first_announcement is not None
        if len(self.version) < self.num_producers and now - self.first_announcement <= self.dead_after_s:
            return 0
        gone = set(self.departed(now))
        live = [v for p, v in self.version.items() if p not in gone]
        assert live, "the newest announcer is never departed"
        return min(live)


def applied_since_start(notes: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """The producers' last applied announcements journaled since the run last started fresh or resumed.

    Args:
        notes: the ledger's replayed notes: ``{"event": "start", "restarts": n, ...}`` at every
            start of the prompt source, ``{"event": "applied", "producer": name, "version": v}``
            per announcement.

    Returns:
        ``[(producer, version)]``: each producer's last ``applied`` note after the last ``start``
        with ``restarts == 0`` (a new producer set began there), ordered by when it was made.
    """
    last: dict[str, int] = {}
    for note in notes:
        if note.get("event") == "start" and note.get("restarts") == 0:
            last.clear()
        elif (
            note.get("event") == "applied"
            and isinstance(note.get("producer"), str)
            and isinstance(note.get("version"), int)
        ):
            last.pop(note["producer"], None)  # re-insert: dict order = order of each producer's last note
            last[note["producer"]] = note["version"]
    return list(last.items())
