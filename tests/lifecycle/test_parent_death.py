"""``lifecycle.parent_death.die_with_parent``: a real grandchild dies with its killed parent (Linux)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from lifecycle.parent_death import die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(60)
"""
CHILD = """
import signal, time
from lifecycle.parent_death import die_with_parent
die_with_parent(signal.{sig})
print("armed", flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie waiting for init counts as dead
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_child_dies_with_its_killed_parent(sig):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD.format(sig=sig)], stdout=subprocess.PIPE, text=True, env=env
    )
    child_pid = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "armed"  # the child (sharing the pipe) is past die_with_parent
    assert _alive(child_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(child_pid)
    if alive:
        os.kill(child_pid, signal.SIGKILL)
    assert not alive, f"the child outlived its parent by 10 s ({sig})"


def test_an_invalid_signal_is_refused():
    with pytest.raises(OSError):
        die_with_parent(1000)
