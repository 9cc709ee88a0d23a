"""Process checks shared by tests that kill things and look for survivors."""

from __future__ import annotations

import os
from pathlib import Path


def exists(pid: int) -> bool:
    """Whether process ``pid`` exists at all; a zombie (exited, not yet reaped by its parent)
    counts as existing: ``not exists(pid)`` for a child says it was reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def running(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (exited, not yet reaped by its parent) counts as gone."""
    if not exists(pid):
        return False
    try:  # the state field follows the command name, which may hold spaces and parentheses
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
