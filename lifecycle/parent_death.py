"""Dying with the parent: ``prctl(PR_SET_PDEATHSIG)`` so a component, rank, ``srun`` step or isolated call never
outlives a killed parent (Linux; a no-op elsewhere). libc's ``prctl`` is resolved at import: ``preexec_fn``-safe."""

from __future__ import annotations

import ctypes
import os
import sys

PR_SET_PDEATHSIG = 1
"""``<linux/prctl.h>``."""

_PRCTL = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None) if sys.platform.startswith("linux") else None


def die_with_parent(sig: int) -> None:
    """Have Linux send ``sig`` when the parent thread exits (one gone already is not caught); OSError if refused."""
    if _PRCTL is not None and _PRCTL(PR_SET_PDEATHSIG, int(sig)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
