"""Dying with the parent: ``prctl(PR_SET_PDEATHSIG)`` asks Linux to signal this process when the thread that
started it exits, so a component, a data-parallel rank, an ``srun`` step or an isolated call never outlives a
killed parent. A no-op on other systems.
"""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1
"""``<linux/prctl.h>``."""

_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int) -> None:
    """Ask Linux to send signal ``sig`` to this process when its parent thread exits (no-op off Linux).

    Safe in a ``preexec_fn`` (libc's ``prctl`` is resolved at import). A parent gone before the call is not
    caught: compare ``os.getppid()`` with the parent's pid after it.

    Raises:
        OSError: ``prctl`` refused (``sig`` is no valid signal number).
    """
    if _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
