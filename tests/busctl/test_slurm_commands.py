"""The Slurm launcher against a real Slurm (:mod:`tests.busctl.slurm_cluster`; skipped, with the
reason, where its daemons cannot run): node-list expansion, ``busctl sbatch`` scripts that
``sbatch --test-only`` accepts, and healing: a component killed on its node ends its ``srun``
step, and the supervisor restarts it as a new step."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from busctl.launchers import make_launcher
from busctl.launchers.slurm import expand_nodelist
from tests.busctl.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from tests.busctl.test_supervisor import log_text, make_cfg, supervisors, table  # noqa: F401


def test_scontrol_expands_nodelists(slurm_cluster: SlurmCluster, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    assert expand_nodelist("gpu[01-03],cpu1") == ["gpu01", "gpu02", "gpu03", "cpu1"]
    assert expand_nodelist(slurm_cluster.node) == [slurm_cluster.node]


def test_sbatch_script_is_accepted(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "busctl",
            "sbatch",
            f"run_dir={tmp_path / 'run'}",
            "trainer.max_steps=3",
            "-o",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "busctl up --launcher slurm" in script.read_text()
    test = subprocess.run(
        ["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60, env=slurm_cluster.environ
    )
    assert test.returncode == 0 and "to start at" in test.stderr, test.stdout + test.stderr


@pytest.fixture
def allocation(slurm_cluster: SlurmCluster, monkeypatch):
    """A job allocation (``salloc --no-shell``) that this test process is inside, as ``busctl up``
    under ``salloc`` would be; cancelled at teardown."""
    out = subprocess.run(
        ["salloc", "--no-shell", "--nodes=1", "--exclusive"],
        capture_output=True,
        text=True,
        timeout=60,
        env=slurm_cluster.environ,
    )
    job = re.search(r"Granted job allocation (\d+)", out.stderr)
    assert job, out.stderr
    for key, value in {
        "SLURM_CONF": str(slurm_cluster.conf),
        "SLURM_JOB_ID": job.group(1),
        "SLURM_JOB_NODELIST": slurm_cluster.node,
    }.items():
        monkeypatch.setenv(key, value)
    yield job.group(1)
    subprocess.run(["scancel", job.group(1)], timeout=60, env=slurm_cluster.environ)


def test_a_killed_step_is_restarted(allocation: str, supervisors, tmp_path: Path) -> None:
    cfg = make_cfg(tmp_path / "run", f"bus.base_port={random.randrange(20_000, 32_000, 100)}")
    cfg.supervisor.launcher = "slurm"
    launcher = make_launcher(cfg)
    launcher.configure(cfg)
    assert cfg.bus.transport == "tcp" and Path(cfg.bus.curve_keys_dir, "server.key_secret").is_file()
    run = supervisors(cfg, table("hub", "rewards-0"), launcher=launcher)
    first = run.all_running()
    real_pid = int(re.findall(r" ready \(pid (\d+)", log_text(run.run_dir, "rewards-0"))[-1])
    assert real_pid != first["rewards-0"]["pid"]  # busctl knows the step by its spawn id
    steps = subprocess.run(
        ["squeue", "--steps", "--noheader", "--format=%j", f"--jobs={allocation}"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    assert {f"rlbus-{n}-{first[n]['pid']}" for n in ("hub", "rewards-0")} <= set(steps), steps
    os.kill(real_pid, signal.SIGKILL)  # the component dies on its node: its srun ends, a dead process to busctl
    run.wait_for(
        "rewards-0 restarted",
        lambda c: c["rewards-0"]["restarts"] == 1 and c["rewards-0"]["state"] in ("ready", "running"),
    )
    assert run.components()["hub"]["restarts"] == 0
