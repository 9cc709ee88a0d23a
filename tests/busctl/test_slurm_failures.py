"""The Slurm launcher when things go wrong, against a real one-node Slurm
(:mod:`tests.busctl.slurm_cluster`; skipped, with the reason, where its daemons cannot run):

- a SIGKILLed ``busctl up`` (its supervisor, in a process of its own) leaves no step behind: each
  ``srun`` gets SIGTERM when busctl dies and cancels its step;
- a failing ``scancel`` falls back to the step's ``srun``, which cancels the step;
- a failing ``squeue`` is retried and is "unknown", not "the step ended": the graceful stop
  still reaches the component;
- a dead node (``scontrol update state=down``, which ends the one-node job with ``NODE_FAIL``)
  fails the run at once, naming the node, with no restart tried;
- spare-node placement over the allocation's live nodes (pure, fake node names).

The failing ``scancel`` / ``squeue`` are shell scripts put first on ``PATH`` that fail as a
client does when slurmctld does not answer; ``srun``, the steps and the other clients are real.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from busctl.components.table import ComponentSpec
from busctl.launchers import NodeLost, make_launcher
from busctl.launchers.nodes import Allocation
from busctl.launchers.slurm import SlurmLauncher
from busctl.launchers.slurm_state import SlurmUnavailable, step_ids
from tests.busctl.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from tests.busctl.test_slurm_commands import allocation  # noqa: F401
from tests.busctl.test_supervisor import make_cfg, supervisors, table  # noqa: F401
from tests.processes import running

GONE_WITHIN_S = 15.0
"""A cancelled step must leave ``squeue`` within this, seconds (the cluster's KillWait is 5 s)."""

SUPERVISOR = """
import sys, time
from pathlib import Path
from rich.console import Console
from busctl.launchers import make_launcher
from busctl.supervisor import Supervisor
from tests.busctl.test_supervisor import make_cfg, table
cfg = make_cfg(Path(sys.argv[1]), f"bus.base_port={sys.argv[2]}", "supervisor.launcher=slurm")
launcher = make_launcher(cfg)
launcher.configure(cfg)
sup = Supervisor(cfg, Console(file=sys.stderr), table=table("hub", "rewards-0"), launcher=launcher)
sup.prepare()
sup.start()
names = " ".join(f"rlbus-{s.name}-{s.pid}" for s in sup.table)
print(names, " ".join(str(s.proc.popen.pid) for s in sup.table), flush=True)
time.sleep(1000)
"""
"""busctl up's supervisor (the hub and a sleepy component as Slurm steps), started, then left running."""

TASK = """
import pathlib, signal, sys, time
marker = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (marker.write_text("graceful"), sys.exit(0)))
print("task up", flush=True)
time.sleep(1000)
"""


def wait_until(what: str, predicate, timeout_s: float = GONE_WITHIN_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.2)


def slurm_lines(*args: str) -> list[str]:
    """The output lines of a Slurm client (a failure is a test error)."""
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout.split("\n")[:-1]


def failing_client(bin_dir: Path, name: str, fails: int) -> Path:
    """``bin_dir/name``: fails its first ``fails`` calls (``slurm_load_jobs error: Socket timed
    out``, exit 1), then runs the real client; returns the file counting its calls."""
    real = subprocess.run(["which", name], capture_output=True, text=True, check=True).stdout.strip()
    calls = bin_dir / f"{name}.calls"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / name
    script.write_text(f"""#!/bin/sh
n=$(cat {calls} 2>/dev/null || echo 0); echo $((n + 1)) > {calls}
if [ "$n" -lt {fails} ]; then
  echo "{name}: error: slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1
fi
exec {real} "$@"
""")
    script.chmod(0o755)
    return calls


def start_task(launcher: SlurmLauncher, tmp_path: Path):
    """Spawn :data:`TASK` as a step; returns (step, its marker file) once the task runs."""
    marker, log_path = tmp_path / "marker", tmp_path / "task.log"
    with log_path.open("ab") as log:
        step = launcher.spawn(
            ComponentSpec("rewards-0", "task"), [sys.executable, "-c", TASK, str(marker)], dict(os.environ), log
        )
    wait_until("the task runs", lambda: "task up" in log_path.read_text(), 60)
    assert step.step_ids(), "the step is not listed"
    return step, marker


def test_a_sigkilled_supervisor_leaves_no_step(allocation: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    parent = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(run_dir), str(random.randrange(20_000, 32_000, 100))],
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "busctl.log").open("wb"),
        text=True,
        cwd=os.getcwd(),
    )
    try:
        line = parent.stdout.readline().split()
        assert line, (tmp_path / "busctl.log").read_text()
        names, sruns = line[:2], [int(pid) for pid in line[2:]]
        assert all(step_ids(name, allocation) for name in names)
        rewards_log = run_dir / "logs" / "rewards-0.log"  # its "ready" line may follow its handshake
        wait_until("rewards-0 logged its pid", lambda: " ready (pid " in rewards_log.read_text())
        tasks = [int(re.findall(r" ready \(pid (\d+)", rewards_log.read_text())[-1])]
        parent.kill()  # busctl up SIGKILLed: nothing of it runs its shutdown
        parent.wait()
        wait_until(
            f"steps {names} gone after busctl's SIGKILL", lambda: not any(step_ids(name, allocation) for name in names)
        )
        wait_until("their sruns and components gone", lambda: not any(running(pid) for pid in sruns + tasks))
    finally:
        parent.kill()


def test_a_failing_scancel_falls_back_to_srun(allocation: str, tmp_path: Path) -> None:
    launcher = make_launcher(make_cfg(tmp_path / "run", "supervisor.launcher=slurm"))
    step, marker = start_task(launcher, tmp_path)
    calls = failing_client(tmp_path / "bin", "scancel", fails=1000)
    with pytest.MonkeyPatch.context() as mp:  # undone before the allocation's own scancel
        mp.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        step.signal(signal.SIGTERM)
    assert int(calls.read_text()) == 1  # scancel was tried (and failed) ...
    step.wait(timeout=GONE_WITHIN_S)  # ... and its srun cancelled the step instead
    wait_until("the step gone", lambda: not step.step_ids())


def test_a_failing_squeue_is_unknown_and_retried(allocation: str, tmp_path: Path) -> None:
    launcher = make_launcher(make_cfg(tmp_path / "run", "supervisor.launcher=slurm"))
    step, marker = start_task(launcher, tmp_path)
    calls = failing_client(tmp_path / "bin", "squeue", fails=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
        with pytest.raises(SlurmUnavailable, match="Socket timed out"):
            step_ids(step.step_name, tries=1)  # unknown: not [] ("ended")
        step.signal(signal.SIGTERM)  # squeue fails once more, answers on the retry: scancel --signal=TERM
    assert int(calls.read_text()) == 3
    assert step.wait(timeout=GONE_WITHIN_S) == 0
    assert marker.read_text() == "graceful"  # the component's own SIGTERM handler ran: not srun's cancel


def test_spare_node_placement() -> None:
    launcher = SlurmLauncher(Allocation((("a", "b", "c"),)), resolve=lambda n: f"addr-{n}")
    producer, rewards = ComponentSpec("producer-0", "producers", 0), ComponentSpec("rewards-1", "rewards", 1)
    assert (launcher.place(producer), launcher.place(rewards)) == ("addr-b", "addr-b")
    launcher.dead.add("c")  # another node: nobody moves
    assert launcher.slot(producer).node == "b"
    launcher.dead.add("b")
    assert launcher.place(producer) == "addr-a" and launcher.slot(rewards).node == "a"
    launcher.dead.add("a")
    with pytest.raises(
        NodeLost, match=r"node a, b, c of the allocation is down and the allocation has no live node left"
    ):
        launcher.slot(producer)
    het = SlurmLauncher(Allocation((("g1", "g2"), ("t1",), ("c1",))), resolve=lambda n: n)
    het.dead.add("g1")
    assert het.slot(producer).node == "g2"
    het.dead.add("t1")
    with pytest.raises(NodeLost, match=r"node t1 of het group 1 \(trainer\) is down"):
        het.slot(ComponentSpec("trainer", "trainer"))


def test_a_dead_node_fails_the_run_naming_it(
    allocation: str, slurm_cluster: SlurmCluster, supervisors, tmp_path: Path
) -> None:
    cfg = make_cfg(
        tmp_path / "run",
        f"bus.base_port={random.randrange(20_000, 32_000, 100)}",
        "supervisor.launcher=slurm",
        "supervisor.max_restarts=20",
    )
    launcher = make_launcher(cfg)
    launcher.configure(cfg)
    run = supervisors(cfg, table("hub", "rewards-0"), launcher=launcher)
    run.all_running()
    node = slurm_cluster.node
    try:
        subprocess.run(
            ["scontrol", "update", f"nodename={node}", "state=down", "reason=rlbus-test"], check=True, timeout=60
        )
        assert run.join() == 1
    finally:  # ReturnToService=2 brings the node back by itself; the job's steps complete once it is
        wait_until(
            "the job and its steps gone, the node idle again",
            lambda: (
                not slurm_lines("squeue", "-h", f"--jobs={allocation}")
                and not slurm_lines("squeue", "-h", "--steps", f"--jobs={allocation}")
                and slurm_lines("sinfo", "-h", "-o", "%T") == ["idle"]
            ),
            90,
        )
    out = run.out.getvalue()
    assert f"Slurm job {allocation} is NODE_FAIL (node {node} of " in out, out
    assert "the allocation is gone" in out and "restart budget" not in out
    assert all(c["restarts"] == 0 for c in run.components().values())
