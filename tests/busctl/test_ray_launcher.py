"""The Ray launcher: its node plan (pure), and components started, killed and restarted on a real
multi-node Ray cluster (:mod:`tests.busctl.ray_cluster`) through the supervisor: components serve
their metrics on their node's address (listed so in ``prometheus.yml``); a node removed under a
component is its crash, and it comes back on a live node.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import yaml

from telemetry.tls import MetricsTls
from busctl.launchers import make_launcher
from busctl.launchers.nodes import Allocation, plan_nodes
from busctl.launchers.ray import allocation_from_ray_nodes
from busctl.scrape import scrape
from tests.busctl.ray_cluster import NODE_ARGS, ray_cluster  # noqa: F401
from tests.busctl.test_supervisor import log_text, make_cfg, supervisors, table  # noqa: F401


def node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 1.0, **resources}, "NodeManagerAddress": "10.0.0.1"}


def test_role_resources_make_the_heterogeneous_plan() -> None:
    nodes = [
        node("w2", producer=1),
        node("head"),
        node("w1", trainer=1),
        node("w3", producer=1),
        node("dead", False, trainer=1),
    ]
    alloc = allocation_from_ray_nodes(nodes, head="head")
    assert alloc == Allocation((("w2", "w3"), ("w1",), ("head",)))
    assert [plan_nodes(alloc, "producer", i).node for i in range(3)] == ["w2", "w3", "w2"]
    assert plan_nodes(alloc, "trainer").node == "w1" and plan_nodes(alloc, "hub").node == "head"


def test_a_group_without_nodes_falls_back_to_the_head() -> None:
    alloc = allocation_from_ray_nodes([node("w2", rewards=1), node("w1", trainer=1), node("head")], head="head")
    assert alloc == Allocation((("head",), ("w1",), ("head", "w2")))  # CPU nodes: head (no role resource) first


def test_without_role_resources_the_plain_plan_runs_the_trainer_on_the_head() -> None:
    alloc = allocation_from_ray_nodes([node("b", GPU=1), node("a", GPU=1), node("head")], head="head")
    assert alloc == Allocation((("head", "a", "b"),))
    assert plan_nodes(alloc, "trainer").node == "head" and plan_nodes(alloc, "producer", 1).node == "b"


def test_no_alive_node_is_an_error() -> None:
    with pytest.raises(ValueError, match="no alive node"):
        allocation_from_ray_nodes([node("head", False)], head="head")


def test_components_of_a_removed_node_restart_on_a_live_one(ray_cluster, supervisors, tmp_path: Path) -> None:
    import ray

    cpu_node = ray_cluster.add_node(**NODE_ARGS, resources={"rewards": 1})  # CPU nodes: head, this one
    ray_cluster.wait_for_nodes()
    cfg = make_cfg(
        tmp_path / "run",
        f"bus.base_port={random.randrange(20_000, 32_000, 100)}",
        "supervisor.launcher=ray",
        f"supervisor.ray_address={ray_cluster.address}",
    )
    launcher = make_launcher(cfg)
    launcher.configure(cfg)
    assert cfg.bus.transport == "tcp" and Path(cfg.bus.curve_keys_dir, "server.key_secret").is_file()
    assert set(cfg.bus.hosts.values()) == {ray.util.get_node_ip_address()}  # one machine: every node has its address
    run = supervisors(cfg, table("hub", "rewards-1"), launcher=launcher)
    first = run.all_running()
    specs = {s.name: s for s in run.sup.table}
    head = ray_cluster.head_node.node_id
    assert (specs["hub"].proc.node, specs["rewards-1"].proc.node) == (head, cpu_node.node_id)
    address = ray.util.get_node_ip_address()  # every node's address here: metrics are served and listed there
    assert {first["hub"]["metrics_host"], first["rewards-1"]["metrics_host"]} == {address}
    targets = yaml.safe_load((run.run_dir / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"]
    assert {t["labels"]["component"]: t["targets"] for t in targets if t["labels"]["component"] != "supervisor"} == {
        name: [f"{address}:{first[name]['metrics_port']}"] for name in ("hub", "rewards-1")
    }
    client = MetricsTls.load(cfg.bus.curve_keys_dir).client_context()  # the run's per-node certificates
    assert (
        client.check_hostname and scrape(first["rewards-1"]["metrics_port"], address, timeout_s=10, tls=client).samples
    )
    real_pid = int(re.findall(r" ready \(pid (\d+)", log_text(run.run_dir, "rewards-1"))[-1])
    assert real_pid != first["rewards-1"]["pid"]  # busctl knows the component by its spawn id
    ray_cluster.remove_node(cpu_node, allow_graceful=False)  # the node dies: its actor, so its component
    run.wait_for(
        "rewards-1 restarted", lambda c: c["rewards-1"]["restarts"] == 1 and c["rewards-1"]["state"] == "running"
    )
    assert specs["rewards-1"].proc.node == head  # the only CPU node left
    assert run.components()["hub"]["restarts"] == 0
