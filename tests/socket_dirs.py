"""Test helper: remove a run's ipc socket directory when it lives outside the run directory."""

from __future__ import annotations

import shutil
from pathlib import Path

from bus.topics import socket_dir


def remove_outside_socket_dir(run_dir: Path) -> None:
    """Delete :func:`bus.topics.socket_dir` of ``run_dir`` if it is the short /tmp fallback (a
    directory inside ``run_dir`` goes with pytest's tmp_path)."""
    sock_dir = socket_dir(run_dir)
    if not sock_dir.is_relative_to(Path(run_dir).resolve()):
        shutil.rmtree(sock_dir, ignore_errors=True)
