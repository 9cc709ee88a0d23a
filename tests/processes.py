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


def cmdline(pid: int) -> str:
    """The command line of ``pid`` (for a failure message), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (e.g. a run's components and the vLLM engine processes they spawned)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            parent_of[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent_of.items() if ppid in frontier} - found
        found |= frontier
    return found
