"""The accounting ledger: every issued prompt ends in exactly one :class:`PromptOutcome` (docs/DELIVERY.md).

The first outcome of an id wins; the same one again is a repeat, a different one a conflict (counted,
listed up to ``max_listed``, the first kept); an outcome of an id never issued is unknown (likewise).
Journal ``RUN_DIR/ledger.jsonl``, one JSON object per line, flushed per write; an issue is journaled
before its prompt is sent, and a reopened ledger replays it (dropping a torn last line)::

    {"event":"issue","id":"p00000003","index":3,"step":1}
    {"event":"outcome","id":"p00000003","outcome":"failed","reason":"failed: RuntimeError"}
    {"event":"<other>", ...}       # the owner's notes (Ledger.note)

``accounting.json`` is a snapshot written atomically (tmp + rename).
"""

from __future__ import annotations

from collections import Counter

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
    """A prompt's outcome; the value is the journal's, ``accounting.json``'s and the metric label's text."""

    TRAINED = "trained"
    DROPPED_STALE = "dropped_stale"
    FILTERED = "filtered"
    FAILED = "failed"


OUTCOMES: tuple[PromptOutcome, ...] = tuple(PromptOutcome)
"""Every outcome a prompt can end in, in the table's order."""

JOURNAL_NAME = "ledger.jsonl"
ACCOUNTING_NAME = "accounting.json"


def outcome_of_drop(reason: str) -> PromptOutcome:
    """``"stale"`` -> dropped_stale, ``"filtered..."`` -> filtered, any other reason -> failed (matched by
    wire text: a stage does not import the packer's ``DropReason``)."""
    if reason == "stale":
        return PromptOutcome.DROPPED_STALE
    if reason.startswith("filtered"):
        return PromptOutcome.FILTERED
    return PromptOutcome.FAILED


@dataclass(frozen=True)
class IssuedPrompt:
    """``index``: issue order (content ``examples[index % len]``); ``step``: the step issued for."""

    index: int
    step: int


class Ledger:
    """Issued prompts and their outcomes, journaled in ``run_dir`` (None: in memory; an existing journal
    is replayed, ``self.replayed``). ``write_interval_s``: seconds between snapshots. ValueError for a
    malformed journal line before the last."""

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
        self.live_per_step: Counter[int] = Counter()  # step -> its issued prompts without an outcome or trained
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
        """Distinct prompts issued (= the next index)."""
        return len(self.issued)

    @property
    def num_not_trained(self) -> int:
        """Issued prompts with an outcome other than ``trained``."""
        return self.num_issued - len(self.open) - self.counts[PromptOutcome.TRAINED]

    def unresolved(self) -> list[str]:
        """Issued ids without an outcome, in issue order."""
        return list(self.open)

    # -------------------------------------------------------------------------------- recording

    def issue(self, prompt_id: str, index: int, step: int) -> None:
        """Record and journal a new prompt, before sending it. ValueError for an id issued already or an
        ``index`` other than ``num_issued`` (content is a function of the index)."""
        if prompt_id in self.issued:
            raise ValueError(f"prompt {prompt_id!r} was issued already (index {self.issued[prompt_id].index})")
        if index != self.num_issued:
            raise ValueError(f"prompt {prompt_id!r}: issue index {index}, expected the next index {self.num_issued}")
        self._apply_issue(prompt_id, index, step)
        self._append({"event": "issue", "id": prompt_id, "index": index, "step": step})

    def record(self, prompt_id: str, outcome: str, reason: str = "") -> str:
        """Record and journal one outcome; returns ``"new"``, ``"repeat"``, ``"conflict"`` or ``"unknown"``.
        ValueError for an outcome not in :data:`OUTCOMES`."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        self._append({"event": "outcome", "id": prompt_id, "outcome": outcome, "reason": reason})
        return self._apply_outcome(prompt_id, outcome, reason)

    def on_trained(self, group_ids: list[str]) -> list[str]:
        """Record ``trained``; returns the ids newly resolved."""
        return [gid for gid in group_ids if self.record(gid, PromptOutcome.TRAINED) == "new"]

    def on_dropped(self, group_ids: list[str], reason: str) -> list[str]:
        """Record a drop's outcome; returns the ids newly resolved."""
        outcome = outcome_of_drop(reason)
        return [gid for gid in group_ids if self.record(gid, outcome, reason) == "new"]

    def note(self, kind: str, **fields: Any) -> None:
        """Journal an owner's event; a replay lists it in ``self.notes``. ValueError for ``kind`` issue or
        outcome, or a field named ``event``."""
        if kind in ("issue", "outcome") or "event" in fields:
            raise ValueError(f"note kind {kind!r} (or a field named 'event') is reserved for the ledger itself")
        self._append({"event": kind, **fields})

    # -------------------------------------------------------------------------------- snapshot

    def accounting(self) -> dict[str, Any]:
        """The ``accounting.json`` snapshot; ``issued == sum(outcomes) + len(unresolved)``."""
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
        """Write ``accounting.json`` atomically; no-op without a run dir."""
        if self.accounting_path is None:
            return
        tmp = self.accounting_path.with_name(self.accounting_path.name + ".tmp")
        tmp.write_text(json.dumps(self.accounting(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.accounting_path)
        self._dirty = False
        self._last_write = time.monotonic()

    def maybe_write_accounting(self, now: float | None = None) -> bool:
        """Write the snapshot if changed and ``write_interval_s`` passed; True if it wrote."""
        now = time.monotonic() if now is None else now
        if not self._dirty or now - self._last_write < self.write_interval_s:
            return False
        self.write_accounting()
        return True

    def close(self) -> None:
        """Write the final snapshot and close the journal; idempotent."""
        if self._journal is not None:
            self.write_accounting()
            self._journal.close()
            self._journal = None

    # -------------------------------------------------------------------------------- internals

    def _apply_issue(self, prompt_id: str, index: int, step: int) -> None:
        self.issued[prompt_id] = IssuedPrompt(index, step)
        if prompt_id not in self.outcomes:
            self.open[prompt_id] = None
        if self.outcomes.get(prompt_id, (PromptOutcome.TRAINED,))[0] == PromptOutcome.TRAINED:
            self.live_per_step[step] += 1
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
            if outcome != PromptOutcome.TRAINED:
                self.live_per_step[self.issued[prompt_id].step] -= 1
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
        """Rebuild the state from the journal at ``path``."""
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
    """``"failed (too_long)"``."""
    return f"{outcome} ({reason})" if reason and reason != outcome else outcome


def _field(event: dict[str, Any], name: str, kind: type, where: str) -> Any:
    """``event[name]`` if a ``kind`` (bools are not ints), else ValueError."""
    value = event.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{where}: field {name!r} must be {kind.__name__}, got {value!r}")
    return value
