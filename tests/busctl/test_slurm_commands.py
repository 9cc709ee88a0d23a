"""``busctl sbatch`` and node-list expansion against a real Slurm (:mod:`tests.busctl.slurm_cluster`;
skipped, with the reason, where its daemons cannot run)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from busctl.launchers.slurm import expand_nodelist
from tests.busctl.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401


def test_scontrol_expands_nodelists(slurm_cluster: SlurmCluster, monkeypatch) -> None:  # noqa: F811
    monkeypatch.setenv("SLURM_CONF", str(slurm_cluster.conf))
    assert expand_nodelist("gpu[01-03],cpu1") == ["gpu01", "gpu02", "gpu03", "cpu1"]
    assert expand_nodelist(slurm_cluster.node) == [slurm_cluster.node]


def test_sbatch_script_is_accepted(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:  # noqa: F811
    script = tmp_path / "job.sh"
    out = subprocess.run([sys.executable, "-m", "busctl", "sbatch", f"run_dir={tmp_path / 'run'}", "trainer.max_steps=3",
                          "-o", str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "busctl up --launcher slurm" in script.read_text()
    test = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=60,
                          env=slurm_cluster.environ)
    assert test.returncode == 0 and "to start at" in test.stderr, test.stdout + test.stderr
