"""The accounting ledger: every prompt the prompt source issues ends in exactly one outcome.

Outcomes (invariant 2 of the design, ``docs/DELIVERY.md``):

| outcome         | announced as                                   | by                          |
|-----------------|------------------------------------------------|-----------------------------|
| ``trained``     | :class:`bus.messages.GroupsTrained`            | trainer, at each checkpoint |
| ``dropped_stale``| ``GroupsDropped`` reason ``"stale"``          | packer                      |
| ``filtered``    | ``GroupsDropped`` reason ``"filtered..."``     | packer                      |
| ``failed``      | ``GroupsDropped``, any other reason (kept)     | producer, packer, others    |

The first outcome recorded for an id wins. The same outcome again is a harmless repeat
(at-least-once delivery re-announces); a *different* outcome later is a **conflict**: counted and
listed, the first one kept. An outcome for an id that was never issued is **unknown**: counted and
listed. Lists of conflicts and unknown ids hold at most ``max_listed`` entries (the counts are
exact); everything else is O(issued prompts).

Journal (``RUN_DIR/ledger.jsonl``): one compact JSON object per line, appended and flushed per
write (a killed process loses at most the line being written; a power loss is not covered, as in
``docs/DELIVERY.md``)::

    {"event":"issue","id":"p00000003","index":3,"step":1}
    {"event":"outcome","id":"p00000003","outcome":"failed","reason":"failed: RuntimeError"}
    {"event":"<other>", ...}       # notes of the owner (see :meth:`Ledger.note`)

An issue is journaled *before* the prompt is sent, so an id is never sent unrecorded (a restart
would otherwise reuse its index). A :class:`Ledger` opened on an existing journal replays it
through the same code path (same state, conflicts and unknowns included), drops a truncated last
line, and appends after it. ``accounting.json`` is a snapshot written atomically (tmp + rename).

No sockets here: :mod:`prompts.source` feeds it from the control channel.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)


class PromptOutcome(StrEnum):
    """The outcome a prompt ends in (the table above); the value is the text of the journal, of
    ``accounting.json`` and of the ``outcome`` label of ``rlbus_accounting_outcomes_total``."""

    TRAINED = "trained"
    DROPPED_STALE = "dropped_stale"
    FILTERED = "filtered"
    FAILED = "failed"


OUTCOMES: tuple[PromptOutcome, ...] = tuple(PromptOutcome)
"""Every outcome a prompt can end in, in the table's order."""

JOURNAL_NAME = "ledger.jsonl"
ACCOUNTING_NAME = "accounting.json"


def outcome_of_drop(reason: str) -> PromptOutcome:
    """The outcome of a ``GroupsDropped`` reason: ``"stale"`` -> ``dropped_stale``, ``"filtered..."``
    -> ``filtered``, anything else (``"failed: RuntimeError"``, ``"too_long"``, ...) -> ``failed``.
    (The packer's reasons are :class:`packer.packer.DropReason`; a stage does not import another,
    so they are matched here by their wire text.)"""
    if reason == "stale":
        return PromptOutcome.DROPPED_STALE
    if reason.startswith("filtered"):
        return PromptOutcome.FILTERED
    return PromptOutcome.FAILED


@dataclass(frozen=True)
class IssuedPrompt:
    """Where an issued prompt came from: ``index`` (issue order; content is ``examples[index %
    len]``) and ``step`` (the step it was issued for)."""

    index: int
    step: int


class Ledger:
    """The prompt source's record of issued prompts and their outcomes, journaled to disk.

    Args:
        run_dir: directory of ``ledger.jsonl`` and ``accounting.json``; ``None`` keeps everything
            in memory (tests, standalone use). An existing journal is replayed (``self.replayed``).
        max_listed: most conflicts and most unknown ids listed (counts stay exact).
        write_interval_s: :meth:`maybe_write_accounting` writes at most this often, seconds.

    Raises:
        ValueError: the journal has a malformed line before its last one (names file and line).
    """

    def __init__(
        self, run_dir: str | Path | None = None, *, max_listed: int = 1000, write_interval_s: float = 2.0
    ) -> None:
        if max_listed < 0 or write_interval_s < 0:
            raise ValueError("max_listed and write_interval_s must be >= 0")
        self.max_listed = max_listed
        self.write_interval_s = write_interval_s
        self.issued: dict[str, IssuedPrompt] = {}
        self.outcomes: dict[str, tuple[str, str]] = {}  # id -> (outcome, reason)
        self.counts: dict[str, int] = dict.fromkeys(PromptOutcome, 0)
        self.failed: dict[str, str] = {}  # id -> reason, for outcome "failed"
        self.open: dict[str, None] = {}  # issued ids without an outcome, in issue order (dict: ordered set)
        self.conflicts: list[dict[str, str]] = []
        self.num_conflicts = 0
        self.unknown: list[str] = []
        self.num_unknown = 0
        self.num_repeats = 0
        self.notes: list[dict[str, Any]] = []  # replayed events of other kinds (see note())
        self.replayed = False
        self._dirty = True
        self._last_write = float("-inf")
        self.journal_path = Path(run_dir) / JOURNAL_NAME if run_dir is not None else None
        self.accounting_path = Path(run_dir) / ACCOUNTING_NAME if run_dir is not None else None
        self._journal: TextIO | None = None
        if self.journal_path is not None:
            if self.journal_path.exists():
                self._replay(self.journal_path)
                self.replayed = True
            self._journal = open(self.journal_path, "a", encoding="utf-8")

    # -------------------------------------------------------------------------------- properties

    @property
    def num_issued(self) -> int:
        """Distinct prompts issued so far (= the next issue index)."""
        return len(self.issued)

    @property
    def num_not_trained(self) -> int:
        """Issued prompts whose outcome is not ``trained`` (each got, or gets, one replacement)."""
        return self.num_issued - len(self.open) - self.counts[PromptOutcome.TRAINED]

    def unresolved(self) -> list[str]:
        """Issued ids without an outcome, in issue order."""
        return list(self.open)

    # -------------------------------------------------------------------------------- recording

    def issue(self, prompt_id: str, index: int, step: int) -> None:
        """Record (and journal) a newly issued prompt; call *before* sending it.

        Raises:
            ValueError: ``prompt_id`` was issued already, or ``index`` is not the next index
                (``num_issued``): content is a function of the index, so indices must not skip.
        """
        if prompt_id in self.issued:
            raise ValueError(f"prompt {prompt_id!r} was issued already (index {self.issued[prompt_id].index})")
        if index != self.num_issued:
            raise ValueError(f"prompt {prompt_id!r}: issue index {index}, expected the next index {self.num_issued}")
        self._apply_issue(prompt_id, index, step)
        self._append({"event": "issue", "id": prompt_id, "index": index, "step": step})

    def record(self, prompt_id: str, outcome: str, reason: str = "") -> str:
        """Record (and journal) one announced outcome.

        Args:
            prompt_id: the group / prompt id. outcome: one of :data:`OUTCOMES`.
            reason: the drop reason (kept for ``failed``).

        Returns:
            ``"new"`` (first outcome of an issued id), ``"repeat"`` (same outcome again),
            ``"conflict"`` (a different outcome after the first; the first is kept) or
            ``"unknown"`` (never issued).

        Raises:
            ValueError: ``outcome`` is not one of :data:`OUTCOMES`.
        """
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        self._append({"event": "outcome", "id": prompt_id, "outcome": outcome, "reason": reason})
        return self._apply_outcome(prompt_id, outcome, reason)

    def on_trained(self, group_ids: list[str]) -> list[str]:
        """Record ``trained`` for ``group_ids``; returns the ids newly resolved."""
        return [gid for gid in group_ids if self.record(gid, PromptOutcome.TRAINED) == "new"]

    def on_dropped(self, group_ids: list[str], reason: str) -> list[str]:
        """Record the outcome of a ``GroupsDropped(reason)``; returns the ids newly resolved."""
        outcome = outcome_of_drop(reason)
        return [gid for gid in group_ids if self.record(gid, outcome, reason) == "new"]

    def note(self, kind: str, **fields: Any) -> None:
        """Journal an event of the owner (e.g. a producer's applied version); a later replay lists
        it, in order, in ``self.notes`` as ``{"event": kind, **fields}``.

        Raises:
            ValueError: ``kind`` is one of the ledger's own (``issue``, ``outcome``), or a field
                is named ``event``.
        """
        if kind in ("issue", "outcome") or "event" in fields:
            raise ValueError(f"note kind {kind!r} (or a field named 'event') is reserved for the ledger itself")
        self._append({"event": kind, **fields})

    # -------------------------------------------------------------------------------- snapshot

    def accounting(self) -> dict[str, Any]:
        """The ``accounting.json`` snapshot.

        Returns:
            ``{"issued": n, "outcomes": {outcome: count}, "unresolved": [ids], "failed": {id:
            reason}, "conflicts": [{"id", "first", "second"}], "unknown": [ids], "num_conflicts",
            "num_unknown", "num_repeats"}``; ``issued == sum(outcomes) + len(unresolved)``.
        """
        return {
            "issued": self.num_issued,
            "outcomes": dict(self.counts),
            "unresolved": self.unresolved(),
            "failed": dict(self.failed),
            "conflicts": list(self.conflicts),
            "unknown": list(self.unknown),
            "num_conflicts": self.num_conflicts,
            "num_unknown": self.num_unknown,
            "num_repeats": self.num_repeats,
        }

    def write_accounting(self) -> None:
        """Write ``accounting.json`` atomically (tmp file + rename); no-op without a run dir."""
        if self.accounting_path is None:
            return
        tmp = self.accounting_path.with_name(self.accounting_path.name + ".tmp")
        tmp.write_text(json.dumps(self.accounting(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.accounting_path)
        self._dirty = False
        self._last_write = time.monotonic()

    def maybe_write_accounting(self, now: float | None = None) -> bool:
        """Write ``accounting.json`` if something changed and ``write_interval_s`` has passed since
        the last write (``now``: ``time.monotonic()`` seconds). Returns True if it wrote."""
        now = time.monotonic() if now is None else now
        if not self._dirty or now - self._last_write < self.write_interval_s:
            return False
        self.write_accounting()
        return True

    def close(self) -> None:
        """Write the final ``accounting.json`` and close the journal (idempotent)."""
        if self._journal is not None:
            self.write_accounting()
            self._journal.close()
            self._journal = None

    # -------------------------------------------------------------------------------- internals

    def _apply_issue(self, prompt_id: str, index: int, step: int) -> None:
        self.issued[prompt_id] = IssuedPrompt(index, step)
        if prompt_id not in self.outcomes:
            self.open[prompt_id] = None
        self._dirty = True

    def _apply_outcome(self, prompt_id: str, outcome: str, reason: str) -> str:
        self._dirty = True
        if prompt_id not in self.issued:
            self.num_unknown += 1
            if len(self.unknown) < self.max_listed:
                self.unknown.append(prompt_id)
            return "unknown"
        first = self.outcomes.get(prompt_id)
        if first is None:
            self.outcomes[prompt_id] = (outcome, reason)
            self.counts[outcome] += 1
            if outcome == PromptOutcome.FAILED:
                self.failed[prompt_id] = reason
            del self.open[prompt_id]
            return "new"
        if first[0] == outcome:
            self.num_repeats += 1
            return "repeat"
        self.num_conflicts += 1
        if len(self.conflicts) < self.max_listed:
            self.conflicts.append({"id": prompt_id, "first": _describe(*first), "second": _describe(outcome, reason)})
        log.warning("prompt %s: outcome %s after %s (conflict; the first one stands)", prompt_id, outcome, first[0])
        return "conflict"

    def _append(self, event: dict[str, Any]) -> None:
        if self._journal is not None:
            self._journal.write(json.dumps(event, separators=(",", ":")) + "\n")
            self._journal.flush()

    def _replay(self, path: Path) -> None:
        """Rebuild the state from the journal at ``path`` (see the module docstring)."""
        with open(path, "rb") as f:
            data = f.read()
        complete = data.rfind(b"\n") + 1  # a killed writer may leave a partial last line
        if complete < len(data):
            log.warning("%s: dropping a truncated last line (%d bytes)", path, len(data) - complete)
            with open(path, "r+b") as f:
                f.truncate(complete)
        for lineno, line in enumerate(data[:complete].decode("utf-8").splitlines(), start=1):
            where = f"{path}:{lineno}"
            try:
                event = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not a JSON line ({exc}); the ledger journal is corrupt") from None
            if not isinstance(event, dict) or not isinstance(event.get("event"), str):
                raise ValueError(f"{where}: expected an object with a string 'event', got {line[:80]!r}")
            kind = event["event"]
            if kind == "issue":
                prompt_id = _field(event, "id", str, where)
                index, step = _field(event, "index", int, where), _field(event, "step", int, where)
                if prompt_id in self.issued or index != self.num_issued:
                    raise ValueError(
                        f"{where}: issue of {prompt_id!r} at index {index} out of order (expected {self.num_issued})"
                    )
                self._apply_issue(prompt_id, index, step)
            elif kind == "outcome":
                outcome = _field(event, "outcome", str, where)
                if outcome not in OUTCOMES:
                    raise ValueError(f"{where}: unknown outcome {outcome!r}")
                self._apply_outcome(_field(event, "id", str, where), outcome, _field(event, "reason", str, where))
            else:
                self.notes.append(event)
        log.info(
            "rebuilt the ledger from %s: %d issued, %d resolved, %d unresolved",
            path,
            self.num_issued,
            self.num_issued - len(self.open),
            len(self.open),
        )


def _describe(outcome: str, reason: str) -> str:
    """``"failed (too_long)"`` for an outcome with a reason other than its own name."""
    return f"{outcome} ({reason})" if reason and reason != outcome else outcome


def _field(event: dict[str, Any], name: str, kind: type, where: str) -> Any:
    """``event[name]`` checked to be a ``kind`` (bools are not ints); ValueError naming ``where``."""
    value = event.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{where}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value
