"""``busctl logs [RUN_DIR] COMPONENT [-f]`` as its own process: prints the log, follows what is
appended (a restart appends to the same file), stops on Ctrl-C with exit code 0."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

from busctl.supervisor import REPO_ROOT

TIMEOUT_S = 30.0


def read_until(proc: subprocess.Popen, text: str, got: str = "") -> str:
    """Read ``proc``'s stdout until ``text`` appeared (fail after TIMEOUT_S)."""
    fd = proc.stdout.fileno()
    while text not in got:
        ready, _, _ = select.select([fd], [], [], TIMEOUT_S)
        assert ready, f"{text!r} not printed within {TIMEOUT_S} s; got {got!r}"
        chunk = os.read(fd, 65536).decode()
        assert chunk, f"busctl logs ended before printing {text!r}; got {got!r}"
        got += chunk
    return got


def test_logs_follow_prints_appended_lines_until_interrupted(tmp_path: Path):
    run_dir = tmp_path / "runs" / "reverse_text"  # the default config's run_dir, relative to the working directory
    (run_dir / "logs").mkdir(parents=True)
    log = run_dir / "logs" / "producer-0.log"
    log.write_text("===== rlbus: starting producer-0 =====\nfirst line\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "busctl", "logs", "producer-0", "-f"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        got = read_until(proc, "first line\n")
        with log.open("a") as f:
            f.write("===== rlbus: starting producer-0 (restart 1) =====\nafter the restart\n")
        got = read_until(proc, "after the restart\n", got)
        assert got.index("first line") < got.index("(restart 1)") < got.index("after the restart")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=TIMEOUT_S) == 0
        assert "Traceback" not in proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_logs_of_an_unknown_component_names_the_known_ones(tmp_path: Path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer.log").write_text("x\n")
    shown = subprocess.run(
        [sys.executable, "-m", "busctl", "logs", str(tmp_path), "producer-9"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert shown.returncode == 1
    assert "no log for 'producer-9'" in shown.stderr and "['trainer']" in shown.stderr  # an error: on stderr
