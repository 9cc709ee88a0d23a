"""Durability helpers shared by the components that keep state on disk (the packer's spool, the
trainer's checkpoints): making a rename or a new file's directory entry survive a power loss; and
atomic (write + rename) status files for busctl and the tracker process.

Invariant: after :func:`fsync_dir` returns, the entries created, renamed or removed in that
directory before the call are on disk (POSIX: a file's own fsync does not cover its name).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["fsync_dir", "write_json_atomic", "write_text_atomic"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync the directory ``directory`` itself, so that its entries (new names, renames) are durable.

    Raises:
        OSError: the directory cannot be opened (missing, not a directory, no permission).
    """
    fd = os.open(Path(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``PATH.tmp`` + rename: readers never see half a file
    (not fsynced: for status files, not for records that must survive a power cut)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json_atomic(path: Path, obj: object) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically (:func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(obj, indent=1))
