"""The packer's durable spool, ``RUN_DIR/packer/spool.bin``: append-only records
``[u32 length][u32 crc32][msgpack [kind, body]]`` (little-endian) from which a restarted or resumed
packer rebuilds its seen ids, buffer, step counter and unreleased steps. Kinds (fsynced unless said):
``start`` (next step; on creation and compaction), ``group`` (an accepted group's codec frames, before
``scored.done``; one fsync per burst), ``step`` (``[step, [group ids]]``, before the step is sent),
``released`` (a ``groups.trained(step)`` seen; flushed only: losing it re-sends a step the trainer
skips), ``seen`` (released groups' ids, by compaction). Drops are not recorded: a re-sent group is
decided again the same way, and a stale group comes back to the buffer and is reported again.

Replay applies the records in order through the live writes' code; a damaged tail (cut short, or a
checksum mismatch: only the unfsynced tail can be) ends it and is cut off and counted. Compaction
rewrites the live state (tmp, fsync, rename, fsync dir) once dead bytes exceed both
:data:`COMPACT_MIN_BYTES` and the live bytes. The story: docs/DELIVERY.md, "The stateful stages".
"""

from __future__ import annotations

import json
import logging
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

import msgpack

from runfiles.checkpoints import checkpoint_step  # noqa: F401 - re-exported: the packer numbers steps from it
from bus.codec import decode, encode
from runfiles.durable import fsync_dir
from bus.messages import ScoredGroup

log = logging.getLogger(__name__)

SPOOL_DIR = "packer"
"""The spool's directory under the run directory."""
SPOOL_NAME = "spool.bin"
COMPACT_MIN_BYTES = 64 * 2**20
"""Dead bytes below which the spool is never compacted (64 MiB)."""
_HEADER = struct.Struct("<II")
_MAX_RECORD = 2**31
TRAINED_SAMPLES = "trained_samples.jsonl"
"""The trainer's record of each step's sample ids ``"{group_id}/{j}"`` in the run directory."""


def trained_group_ids(run_dir: str | os.PathLike[str], below_step: int) -> list[str]:
    """The ids of the groups trained in steps ``< below_step`` (``trained_samples.jsonl``; a torn last
    line ignored), first seen first: a resumed packer without a spool marks them seen, so copies the
    prompt source re-issues before their ``groups.trained`` reaches the ledger are not trained twice."""
    path = Path(run_dir) / TRAINED_SAMPLES
    if not path.is_file():
        return []
    ids: dict[str, None] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the crash: its step is not covered by any checkpoint
        if isinstance(record, dict) and int(record.get("step", below_step)) < below_step:
            ids.update(dict.fromkeys(str(s).rsplit("/", 1)[0] for s in record.get("sample_ids", [])))
    return list(ids)


@dataclass
class SpoolState:
    """What the spool holds (after replay, kept current by every write).

    Attributes:
        next_step: the step the packer numbers next. seen: every group id ever accepted.
        groups: accepted groups not yet in a released step, by id. buffered: ids not yet planned.
        steps: planned, unreleased steps -> group ids in packing order. released_through: -1 for none.
    """

    next_step: int = 0
    seen: set[str] = field(default_factory=set)
    groups: dict[str, ScoredGroup] = field(default_factory=dict)
    buffered: dict[str, None] = field(default_factory=dict)
    steps: dict[int, list[str]] = field(default_factory=dict)
    released_through: int = -1


class Spool:
    """The packer's spool in ``directory`` (``RUN_DIR/packer``, created if missing), replayed on open.

    Args:
        first_step: where a new spool numbers steps from (a resume without spool: the checkpoint's
            step); an existing one continues from its own, or from ``first_step`` if higher.

    Raises:
        ValueError: ``first_step < 0``.
    """

    def __init__(
        self, directory: str | os.PathLike[str], first_step: int = 0, *, compact_min_bytes: int = COMPACT_MIN_BYTES
    ) -> None:
        if first_step < 0:
            raise ValueError(f"first_step must be >= 0, got {first_step}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / SPOOL_NAME
        self.compact_min_bytes = compact_min_bytes
        self.state = SpoolState()
        self.sizes: dict[str, int] = {}  # live group id -> bytes of its record
        self.dead_bytes = 0
        self.torn_records = 0
        self.existed = self.path.is_file()
        good = self._replay() if self.existed else 0
        self.log = RecordLog(open_for_append(self.path, good))
        if not self.existed or first_step > self.state.next_step:
            self._write("start", max(first_step, self.state.next_step), sync=True)

    # -- writes ----------------------------------------------------------------------------------

    def accepted(self, group: ScoredGroup, *, sync: bool = True) -> None:
        """Record an accepted group, fsynced (``sync=False``: flushed; ``log.sync()`` before releasing it)."""
        self._write("group", [bytes(f) for f in encode(group)], sync=sync, group=group)

    def planned(self, step: int, group_ids: list[str]) -> None:
        """Record that ``step`` takes ``group_ids`` (fsynced: before sending the step). ValueError if
        ``step`` is not the next step or an id is not buffered."""
        if step != self.state.next_step:
            raise ValueError(f"step {step} planned but the spool's next step is {self.state.next_step}")
        missing = [g for g in group_ids if g not in self.state.buffered]
        if missing:
            raise ValueError(f"step {step} takes groups not buffered in the spool: {missing[:3]}")
        self._write("step", [step, list(group_ids)], sync=True)

    def mark_seen(self, group_ids: list[str]) -> None:
        """Record ``group_ids`` as decided on (duplicates from now on, also after a restart); fsynced."""
        if group_ids:
            self._write("seen", sorted(set(group_ids)), sync=True)

    def released(self, step: int) -> None:
        """Record that every step ``<= step`` is released (flushed only; nothing if none is new)."""
        if step > self.state.released_through and any(s <= step for s in self.state.steps):
            self._write("released", step, sync=False)

    def should_compact(self) -> bool:
        """Dead bytes exceed both the minimum and the live bytes."""
        return self.dead_bytes > max(self.compact_min_bytes, sum(self.sizes.values()))

    def compact(self, buffered: list[str] | None = None) -> None:
        """Rewrite the spool with its live state only, atomically; ``buffered``: the packer's buffer (ids in
        order) when stale groups left it since they were recorded (None: the spool's)."""
        old = self.state
        keep = list(old.buffered) if buffered is None else [g for g in buffered if g in old.buffered]
        live = [g for ids in old.steps.values() for g in ids] + keep
        records: list[tuple[str, Any]] = [("start", old.next_step)]
        dead = sorted(old.seen - set(live))
        if dead:
            records.append(("seen", dead))
        for gid in live:
            records.append(("group", [bytes(f) for f in encode(old.groups[gid])]))
        records += [("step", [s, ids]) for s, ids in old.steps.items()]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            for kind, body in records:
                f.write(frame_record(kind, body))
            f.flush()
            os.fsync(f.fileno())
        self.log.close()
        os.replace(tmp, self.path)
        fsync_dir(self.directory)
        self.state, self.sizes, self.dead_bytes = SpoolState(), {}, 0
        good = self._replay()
        self.log = RecordLog(open_for_append(self.path, good))
        self.state.released_through = old.released_through
        log.info(
            "spool compacted: %d live group(s), %d step(s) not released, %d bytes", len(live), len(old.steps), good
        )

    def close(self) -> None:
        """Flush and close the file."""
        self.log.close()

    # -- internals -------------------------------------------------------------------------------

    def _write(self, kind: str, body: Any, *, sync: bool, group: ScoredGroup | None = None) -> None:
        self._apply(kind, body, self.log.append(kind, body, sync=sync), group)

    def _apply(self, kind: str, body: Any, nbytes: int, group: ScoredGroup | None = None) -> None:
        st = self.state
        if kind == "start":
            st.next_step = max(st.next_step, int(body))
        elif kind == "group":
            g = group if group is not None else decode(body)
            if not isinstance(g, ScoredGroup):
                raise ValueError(f"spool group record holds a {type(g).__name__}")
            st.seen.add(g.id)
            st.groups[g.id] = g
            st.buffered[g.id] = None
            self.sizes[g.id] = nbytes
        elif kind == "step":
            step, ids = int(body[0]), [str(g) for g in body[1]]
            st.steps[step] = ids
            for gid in ids:
                st.buffered.pop(gid, None)
            st.next_step = max(st.next_step, step + 1)
        elif kind == "released":
            for step in [s for s in st.steps if s <= int(body)]:
                for gid in st.steps.pop(step):
                    st.groups.pop(gid, None)
                    self.dead_bytes += self.sizes.pop(gid, 0)
            st.released_through = max(st.released_through, int(body))
        elif kind == "seen":
            st.seen.update(str(g) for g in body)
        else:
            raise ValueError(f"unknown spool record kind {kind!r}")

    def _replay(self) -> int:
        """Apply every intact record; returns the offset after the last one."""
        offset, torn = replay_records(self.path, lambda kind, body, size: self._apply(kind, body, size), "spool")
        self.torn_records += torn
        return offset


def open_for_append(path: Path, good: int) -> BinaryIO:
    """``path`` (created if missing) opened for appending after its first ``good`` bytes (the rest cut off)."""
    f = open(path, "r+b" if path.is_file() else "wb")
    f.truncate(good)
    f.seek(good)
    return f


class RecordLog:
    """An append-only file of :func:`frame_record` records with group commit: records appended with
    ``sync=False`` are flushed, and fsynced together by :meth:`sync`. ``fsyncs`` counts them."""

    def __init__(self, file: BinaryIO) -> None:
        self.file, self.unsynced, self.fsyncs = file, False, 0

    def append(self, kind: str, body: Any, *, sync: bool) -> int:
        """Write and flush one record, fsynced with ``sync``; returns its size in bytes."""
        record = frame_record(kind, body)
        self.file.write(record)
        self.file.flush()
        self.unsynced = True
        if sync:
            self.sync()
        return len(record)

    def sync(self) -> None:
        """Fsync every record appended since the last fsync; nothing if none."""
        if self.unsynced:
            os.fsync(self.file.fileno())
            self.unsynced, self.fsyncs = False, self.fsyncs + 1

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if not self.file.closed:
            self.file.flush()
            self.file.close()


def replay_records(path: Path, apply: Callable[[str, Any, int], None], what: str) -> tuple[int, int]:
    """``apply(kind, body, size_bytes)`` each intact record of ``path`` in order, stopping at the first torn
    one or one ``apply`` raises on (logged naming ``what``); returns (offset after the last applied
    record, 1 if a damaged tail was left else 0)."""
    data = path.read_bytes()
    offset = 0
    while offset < len(data):
        record = read_record(data, offset)
        if record is None:
            break
        (kind, body), end = record
        try:
            apply(kind, body, end - offset)
        except Exception as exc:  # a record that does not decode is damaged like a torn one
            log.error("%s record at byte %d unreadable (%s: %s)", what, offset, type(exc).__name__, exc)
            break
        offset = end
    if offset < len(data):
        log.warning(
            "%s %s: dropped a damaged tail of %d bytes at byte %d (a write cut short by a crash)",
            what,
            path,
            len(data) - offset,
            offset,
        )
        return offset, 1
    return offset, 0


def frame_record(kind: str, body: Any) -> bytes:
    payload = msgpack.packb([kind, body], use_bin_type=True)
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_record(data: bytes, offset: int) -> tuple[tuple[str, Any], int] | None:
    """The record at ``offset`` and the offset after it; None if cut short or damaged."""
    if offset + _HEADER.size > len(data):
        return None
    length, crc = _HEADER.unpack_from(data, offset)
    start, end = offset + _HEADER.size, offset + _HEADER.size + length
    if length > _MAX_RECORD or end > len(data) or zlib.crc32(data[start:end]) != crc:
        return None
    try:
        kind, body = msgpack.unpackb(data[start:end], raw=False)
    except Exception:
        return None
    return (kind, body), end
