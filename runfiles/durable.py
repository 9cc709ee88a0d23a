"""Durable and atomic writes of run files: :func:`fsync_dir` makes a directory's new names and renames survive a
power loss (a file's own fsync does not cover its name); atomic, unsynced status files for busctl and trackers."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["fsync_dir", "write_json_atomic", "write_text_atomic"]


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync ``directory`` itself, so its new names and renames are durable; OSError if it cannot be opened."""
    fd = os.open(Path(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` through ``PATH.tmp`` + rename (readers never see half a file; not fsynced)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json_atomic(path: Path, obj: object) -> None:
    """:func:`write_text_atomic` of ``obj`` as indented JSON."""
    write_text_atomic(path, json.dumps(obj, indent=1))
