"""A component orphaned by a SIGKILLed supervisor whose graceful stop hangs still goes away, with
every process of its group (:func:`bus.component._on_stop_signal`): a real component process
(``tests/busctl/sleepy.py`` through :func:`bus.component.component_main`) under a real parent
process that is SIGKILLed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from bus.component import ORPHAN_GRACE_S
from configs.schema import dump_config
from tests.processes import running
from tests.busctl.test_supervisor import make_cfg

PARENT = """
import subprocess, sys, time
child = subprocess.Popen(sys.argv[1:], start_new_session=True)
print(child.pid, flush=True)
time.sleep(1000)
"""


def test_orphan_with_a_hung_stop_kills_its_process_group(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = make_cfg(run_dir, "bus.ready_timeout_s=5")
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "hang-close-rewards-0").touch()
    log_path = tmp_path / "rewards-0.log"
    with log_path.open("wb") as log_file:
        parent = subprocess.Popen(
            [
                sys.executable,
                "-c",
                PARENT,
                sys.executable,
                "-m",
                "tests.busctl.sleepy",
                "--run-dir",
                str(run_dir),
                "--name",
                "rewards-0",
                "--index",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            cwd=os.getcwd(),
        )
    pids: list[int] = []
    try:
        pids.append(int(parent.stdout.readline()))
        deadline = time.monotonic() + 60
        while not (found := re.search(r"child pid (\d+)", log_path.read_text())) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert found, log_path.read_text()
        pids.append(int(found.group(1)))
        while "ready (pid" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        parent.kill()  # the supervisor's SIGKILL: PR_SET_PDEATHSIG sends SIGTERM, close() hangs
        parent.wait()
        time.sleep(1.0)
        assert all(running(p) for p in pids), "the component or its child died before the grace period"
        deadline = time.monotonic() + ORPHAN_GRACE_S + 15
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = [p for p in pids if running(p)]
    finally:
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    assert not survivors, f"{survivors} outlived the orphan grace period:\n{log_path.read_text()}"
