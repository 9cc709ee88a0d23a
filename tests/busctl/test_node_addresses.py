"""Per-node addresses with real processes on one host, with 127.0.0.2 (a loopback address of this
host: reachable, yet not 127.0.0.1) as "another node's" address:

- components started with a node address (``LocalLauncher(node_address=...)``, as the Slurm and
  Ray launchers set ``RLBUS_NODE_ADDRESS``) serve their metrics there and not on 127.0.0.1;
  ``prometheus.yml``, the metrics poller and ``busctl status`` read them there;
- the hub restarted at another address (its node died and it landed elsewhere) moves the control
  endpoints: ``config.yaml`` is rewritten, its connectors restart, and busctl's own control
  subscription follows it (a ``run.done`` published at the new address ends the run).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from busctl.launchers.local import LocalLauncher
from tests.busctl.test_supervisor import log_text, make_cfg, publish_run_done, supervisors, table  # noqa: F401

OTHER = "127.0.0.2"


def tcp_cfg(run_dir: Path, hub_host: str):
    """A tcp run with the hub's endpoints at ``hub_host`` and busctl at 127.0.0.1 (as a multi-node launcher
    writes ``bus.hosts``)."""
    cfg = make_cfg(run_dir, "bus.transport=tcp", f"bus.base_port={random.randrange(20_000, 32_000, 100)}")
    cfg.bus.hosts = {"control_pub": hub_host, "control_sub": hub_host, "supervisor": "127.0.0.1"}
    return cfg


def test_metrics_are_served_and_read_at_the_nodes_address(supervisors, tmp_path: Path) -> None:
    run = supervisors(
        tcp_cfg(tmp_path / "run", OTHER), table("hub", "rewards-0"), launcher=LocalLauncher(node_address=OTHER)
    )
    comps = run.all_running()
    assert {c["metrics_host"] for c in comps.values()} == {OTHER}
    statics = yaml.safe_load((run.run_dir / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"]
    targets = {s["labels"]["component"]: s["targets"] for s in statics}
    assert targets["hub"] == [f"{OTHER}:{comps['hub']['metrics_port']}"]
    assert targets["rewards-0"] == [f"{OTHER}:{comps['rewards-0']['metrics_port']}"]
    assert targets["supervisor"] == [
        f"127.0.0.1:{run.status()['metrics_port']}"
    ]  # busctl's node: 127.0.0.1 in bus.hosts
    for name in ("hub", "rewards-0"):
        with urllib.request.urlopen(f"http://{OTHER}:{comps[name]['metrics_port']}/metrics", timeout=5) as resp:
            assert b"rlbus_" in resp.read()
        with pytest.raises(OSError):  # bound to the node's address only
            urllib.request.urlopen(f"http://127.0.0.1:{comps[name]['metrics_port']}/metrics", timeout=5)
    run.wait_for("the poller read both", lambda c: set(run.sup.poller.stats) == {"hub", "rewards-0"})
    assert run.sup.poller.failures == {}
    out = subprocess.run(
        [sys.executable, "-m", "busctl", "status", str(run.run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.returncode == 0, out.stderr
    assert f"{OTHER}:{comps['rewards-0']['metrics_port']}" in out.stdout, out.stdout


class MovingLauncher(LocalLauncher):
    """Local processes; a restarted hub is placed "on another node" at 127.0.0.2."""

    def place(self, spec) -> str:
        self.node_address = OTHER if spec.name == "hub" and spec.restarts else ""
        return self.node_address


def test_a_hub_restarted_at_another_address_is_found_by_everyone(supervisors, tmp_path: Path) -> None:
    run = supervisors(
        tcp_cfg(tmp_path / "run", "127.0.0.1"), table("hub", "rewards-0", "producer-0"), launcher=MovingLauncher()
    )
    first = run.all_running()
    os.kill(first["hub"]["pid"], signal.SIGKILL)  # its node "died"
    comps = run.wait_for(
        "hub moved, its peers restarted",
        lambda c: all(r["restarts"] == 1 and r["state"] == "running" for r in c.values()),
    )
    assert comps["hub"]["metrics_host"] == OTHER
    hosts = yaml.safe_load((run.run_dir / "config.yaml").read_text())["bus"]["hosts"]
    assert (hosts["control_pub"], hosts["control_sub"], hosts["supervisor"]) == (OTHER, OTHER, "127.0.0.1")
    assert "starting rewards-0 (restart 1)" in log_text(run.run_dir, "rewards-0")
    assert f"moved hub to {OTHER} (control_pub, control_sub); restarting rewards-0, producer-0" in run.out.getvalue()
    assert run.sup.endpoints.address("control_pub").startswith(f"tcp://{OTHER}:")
    publish_run_done(run)  # through the hub at its new address to busctl's new subscription
    assert run.join() == 0, run.out.getvalue()
