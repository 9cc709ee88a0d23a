"""Ordering and deduplication of a model's calls (pure, clock passed in). The Tinker SDK numbers each training
client's requests (``seq_id``, from 1) and sends a big batch's chunks in parallel, the first chunk last: a
call runs only after the calls numbered before it. A retry of ``(model_id, seq_id)`` gets the request id of
the first copy. A gap that stays open ``gap_timeout_s`` (a client that skipped a number) is closed by
releasing the lowest held call, so nothing waits forever. Calls without a ``seq_id`` go at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Model:
    next_seq: int | None = None
    held: dict[int, tuple[float, Any]] = field(default_factory=dict)


class Sequencer:
    """Per model: the next ``seq_id`` due, the calls held for it, and the ids of every call seen."""

    def __init__(self, gap_timeout_s: float = 5.0) -> None:
        self.gap_timeout_s = gap_timeout_s
        self._models: dict[str, _Model] = {}
        self._seen: dict[tuple[str, int], str] = {}

    def start(self, model_id: str, next_seq: int = 1) -> None:
        """A new model whose first call is ``next_seq`` (the SDK's first training call is 1)."""
        self._models.setdefault(model_id, _Model(next_seq=next_seq))

    def known(self, model_id: str, seq_id: int | None) -> str | None:
        """The request id of an earlier copy of this call, or None."""
        return None if seq_id is None else self._seen.get((model_id, seq_id))

    def offer(self, model_id: str, seq_id: int | None, request_id: str, item: Any, now: float) -> list[Any]:
        """Take a new call; returns the calls now due, in order (``item`` among them, or held)."""
        if seq_id is None:
            return [item]
        self._seen[(model_id, seq_id)] = request_id
        m = self._models.setdefault(model_id, _Model())
        if m.next_seq is None:
            m.next_seq = seq_id
        if seq_id < m.next_seq:  # late after a gap was closed: run it rather than lose it
            return [item]
        m.held[seq_id] = (now, item)
        return self._drain(m)

    def expire(self, now: float) -> list[Any]:
        """Close gaps open longer than ``gap_timeout_s``; returns the calls released."""
        out: list[Any] = []
        for m in self._models.values():
            if m.held and m.next_seq not in m.held:
                lowest = min(m.held)
                if now - min(t for t, _ in m.held.values()) >= self.gap_timeout_s:
                    m.next_seq = lowest
                    out += self._drain(m)
        return out

    def depth(self, model_id: str) -> int:
        """Calls of ``model_id`` held back."""
        m = self._models.get(model_id)
        return len(m.held) if m else 0

    def models(self) -> list[str]:
        return list(self._models)

    @staticmethod
    def _drain(m: _Model) -> list[Any]:
        out = []
        while m.next_seq in m.held:
            out.append(m.held.pop(m.next_seq)[1])
            m.next_seq += 1
        return out
