"""The packer's durable spool: an append-only file of accepted groups and of the step plan, from
which a restarted packer (supervisor restart or ``busctl up --resume``) rebuilds its state.

File: ``RUN_DIR/packer/spool.bin``, a sequence of records ``[u32 length][u32 crc32][payload]``
(little-endian; ``payload`` = msgpack ``[kind, body]``):

| kind        | body                               | written                                      | fsync |
|-------------|------------------------------------|----------------------------------------------|-------|
| ``start``   | ``next_step``                      | creating the file (and by compaction)        | yes   |
| ``group``   | the :func:`bus.codec.encode` frames of an accepted :class:`ScoredGroup` | before ``scored.done`` | yes |
| ``step``    | ``[step, [group ids]]``            | before the step's first micro-batch is sent  | yes   |
| ``released``| ``step``                           | a ``groups.trained(step)`` was seen          | no    |
| ``seen``    | ``[group ids]``                    | by compaction: ids of released groups        | yes   |

Fsync policy (why): a ``group`` record is fsynced before the packer releases custody of the
group upstream (``scored.done``), since after that no reward worker holds it; a ``step`` record
is fsynced before the step's micro-batches leave, since the trainer may train them and a
restarted packer must emit that step again with the same groups (same micro-batch ids and
contents, :func:`packer.assemble.pack_groups` is deterministic) and never put those groups into
another step. Group commit: :meth:`Spool.accepted` with ``sync=False`` only flushes, and the packer
fsyncs once (:meth:`RecordLog.sync`) after deciding on every group it has already received, before
releasing any of them (``packer.proc.PackerProc._take_received``). A ``released`` record is only flushed: losing it makes a restarted packer re-send
steps the trainer's checkpoint already covers, which the trainer releases without training.

Replay: records are applied in order by the same code as live writes (:meth:`Spool._apply`).
A damaged tail (a record cut short by a crash mid-write, or a checksum mismatch) ends the replay:
it and everything after it are dropped (counted in :attr:`Spool.torn_records`, logged) and the
file is truncated there before appending. Only the unfsynced tail can be damaged, so no record
whose write was acknowledged is lost.

Compaction (bounded size): once the bytes of ``group`` records of released steps (dead bytes)
exceed both :data:`COMPACT_MIN_BYTES` and the bytes of live ones (groups buffered or in
unreleased steps), :meth:`Spool.compact` rewrites the file with only the live state (``start``,
``seen``, live ``group`` and ``step`` records) into ``spool.bin.tmp``, fsyncs it, renames it over
the spool and fsyncs the directory. The file therefore stays below about twice the live bytes
plus :data:`COMPACT_MIN_BYTES`, and each byte is rewritten O(1) times on average. The seen-id set
(every accepted id of the run) is kept: it is the packer's run-wide duplicate guard.

Drops are not recorded: a group dropped on arrival (filtered, too long, ...) that is re-sent to a
restarted packer is decided again, the same way, and its repeated drop report is a harmless repeat
for the ledger (no second replacement). Groups dropped from the buffer as stale are not recorded
either: a restarted packer gets them back in
its buffer and drops them again at its next step (the ledger treats the repeated outcome as a
harmless repeat), so a drop whose report died with the packer is still reported.
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
"""The trainer's record of trained samples under the run directory (one JSON line per step,
``{"step": s, "sample_ids": ["{group_id}/{j}", ...], ...}``; :mod:`trainer.proc`)."""


def trained_group_ids(run_dir: str | os.PathLike[str], below_step: int) -> list[str]:
    """The ids of the groups the trainer trained in steps ``< below_step``, from ``run_dir``'s
    ``trained_samples.jsonl`` (missing file: none; a torn last line is ignored), in first-seen order.

    A resumed run without a spool seeds its seen-id set with them (:meth:`Spool.mark_seen`): those
    groups are trained in the surviving lineage (the checkpoint covers their steps), but their
    ``groups.trained`` may not have reached the ledger before the crash, so the prompt source
    re-issues them; their copies must then be dropped as duplicates, not trained a second time.
    A sample id ``"{group_id}/{j}"`` belongs to the group before its last ``/``."""
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
    """What the spool holds (after replay, and kept current by every write).

    Attributes:
        next_step: the step the packer numbers next.
        seen: every group id ever accepted (the run-wide duplicate guard).
        groups: accepted groups not yet in a released step, by id.
        buffered: ids of accepted groups not yet planned, in acceptance order.
        steps: planned, unreleased steps: step -> group ids in packing order (ascending steps).
        released_through: the highest released step (-1: none).
    """

    next_step: int = 0
    seen: set[str] = field(default_factory=set)
    groups: dict[str, ScoredGroup] = field(default_factory=dict)
    buffered: dict[str, None] = field(default_factory=dict)
    steps: dict[int, list[str]] = field(default_factory=dict)
    released_through: int = -1


class Spool:
    """The packer's spool in ``directory`` (created if missing), replayed on open.

    Args:
        directory: ``RUN_DIR/packer``.
        first_step: the step to number from when the spool is new (a resumed run without spool:
            the trainer's checkpoint step); an existing spool continues from its own state (or
            from ``first_step`` if that is higher).
        compact_min_bytes: see :data:`COMPACT_MIN_BYTES`.

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
        """Record an accepted group (fsynced: call before releasing it upstream). ``sync=False``
        only flushes it: call ``log.sync()`` before releasing it (one fsync for a burst of groups)."""
        self._write("group", [bytes(f) for f in encode(group)], sync=sync, group=group)

    def planned(self, step: int, group_ids: list[str]) -> None:
        """Record that ``step`` takes ``group_ids`` (fsynced: call before sending the step).

        Raises:
            ValueError: ``step`` is not the next step, or an id is not buffered.
        """
        if step != self.state.next_step:
            raise ValueError(f"step {step} planned but the spool's next step is {self.state.next_step}")
        missing = [g for g in group_ids if g not in self.state.buffered]
        if missing:
            raise ValueError(f"step {step} takes groups not buffered in the spool: {missing[:3]}")
        self._write("step", [step, list(group_ids)], sync=True)

    def mark_seen(self, group_ids: list[str]) -> None:
        """Record ``group_ids`` as decided on (a ``seen`` record, fsynced; nothing if empty): a
        group with one of these ids is a duplicate from now on, also after a restart."""
        if group_ids:
            self._write("seen", sorted(set(group_ids)), sync=True)

    def released(self, step: int) -> None:
        """Record that the trainer released every step ``<= step`` (flushed, not fsynced); a no-op
        if no planned step is newly released."""
        if step > self.state.released_through and any(s <= step for s in self.state.steps):
            self._write("released", step, sync=False)

    def should_compact(self) -> bool:
        """Dead bytes exceed both the minimum and the live bytes (see the module docstring)."""
        return self.dead_bytes > max(self.compact_min_bytes, sum(self.sizes.values()))

    def compact(self, buffered: list[str] | None = None) -> None:
        """Rewrite the spool with only its live state (atomically: tmp, fsync, rename, fsync dir).

        Args:
            buffered: the packer's current buffer (ids, in order) if groups were dropped from it
                since they were recorded (stale); None: keep the spool's buffer.
        """
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
    """``path`` opened for appending records after its first ``good`` bytes (the intact records
    :func:`replay_records` read; the damaged tail after them is cut off), created if missing."""
    f = open(path, "r+b" if path.is_file() else "wb")
    f.truncate(good)
    f.seek(good)
    return f


class RecordLog:
    """An append-only file of :func:`frame_record` records with group commit: a record appended
    with ``sync=False`` is only flushed until :meth:`sync` fsyncs it with every other one since
    the last fsync.

    Attributes:
        unsynced: records were appended (flushed) since the last fsync.
        fsyncs: fsyncs of appended records through this log (tests, logs).
    """

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
    """Read the records of ``path`` in order and ``apply(kind, body, size_bytes)`` each intact one.

    Reading stops at the first record that is torn (a write cut short by a crash: short or crc
    mismatch, :func:`read_record`) or whose ``apply`` raises (damaged like a torn one: logged as
    an error naming ``what`` and the byte offset); what follows is the damaged tail.

    Returns:
        (offset after the last applied record, 1 if a damaged tail was dropped else 0).
    """
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
    """The record at ``offset`` and the offset after it, or None if it is cut short or damaged."""
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
