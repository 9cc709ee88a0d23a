"""Durability helpers shared by the components that keep state on disk (the packer's spool, the
trainer's checkpoints): making a rename or a new file's directory entry survive a power loss.

Invariant: after :func:`fsync_dir` returns, the entries created, renamed or removed in that
directory before the call are on disk (POSIX: a file's own fsync does not cover its name).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir"]


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
