"""The producers' applied policy versions as the prompt source's gate sees them: its
``policy_version`` is the minimum over the live producers' ``weights.applied`` announcements.
"""

from __future__ import annotations

from typing import Any


class AppliedVersions:
    """A producer's newest announcement wins, also a lower one (a resumed trainer rolls back). The
    version is 0 until the ``num_producers`` initial producers each announced, or ``dead_after_s``
    passed since the first announcement. A producer behind another's announcement for over
    ``dead_after_s`` (dead or removed) is ignored until it announces again. Times: monotonic seconds.
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
        """``producer`` now runs ``version``."""
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
        """Producers ignored at ``now``."""
        return sorted(p for p, t in self.behind_since.items() if now - t > self.dead_after_s)

    def policy_version(self, now: float) -> int:
        """The version every live producer runs (class docstring)."""
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
    """``[(producer, version)]``: each producer's last ``applied`` note after the last ``start`` note with
    ``restarts == 0`` (where the producer set began), in note order."""
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
