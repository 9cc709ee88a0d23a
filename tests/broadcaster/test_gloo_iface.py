"""broadcaster.gloo_iface: the interface a gloo weight group binds is the one facing the rendezvous.

The last test forms a real gloo group (vLLM's stateless group, as the trainer and the producers'
workers do) between two processes in two network namespaces joined by a veth pair
(:mod:`tests.busctl.netns`; skipped where namespaces cannot be made): on this machine the host
name resolves to 127.0.0.1, so without :func:`pin_gloo_interface` both ranks advertise the
loopback and the group cannot connect.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broadcaster.gloo_iface import ENV_GLOO_IFNAME, ENV_PINNED, interface_of, local_address_towards, pin_gloo_interface
from tests.busctl.netns import ADDR_A, NetnsPair, netns_pair  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_ifname(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (ENV_GLOO_IFNAME, ENV_PINNED):
        monkeypatch.setenv(name, "")  # recorded first, so what a test pins is undone after it
        monkeypatch.delenv(name)


def test_loopback_route_and_interface() -> None:
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: held by no interface here


def test_pin_sets_the_interface_facing_the_host(no_ifname: None) -> None:
    assert pin_gloo_interface("127.0.0.1") == "lo"
    assert os.environ[ENV_GLOO_IFNAME] == "lo"


def test_pin_keeps_the_users_choice(no_ifname: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_GLOO_IFNAME, "eth7")
    assert pin_gloo_interface("127.0.0.1") == "eth7"
    assert os.environ[ENV_GLOO_IFNAME] == "eth7"


PIN_IN_CHILD = "from broadcaster.gloo_iface import pin_gloo_interface; print(pin_gloo_interface('127.0.0.1'))"


def test_a_pin_inherited_by_a_child_is_pinned_again(no_ifname: None) -> None:
    """A process that pinned an interface for its own group starts a component (busctl's pytest
    run, a supervisor): the child re-pins for its rendezvous; a value without the mark is the user's."""
    pin_gloo_interface("127.0.0.1")
    assert os.environ[ENV_PINNED] == os.environ[ENV_GLOO_IFNAME] == "lo"
    inherited = {**os.environ, ENV_GLOO_IFNAME: "eth-stale", ENV_PINNED: "eth-stale", "PYTHONPATH": str(ROOT)}
    users = {**inherited, ENV_PINNED: ""}
    run = lambda env: subprocess.run(
        [sys.executable, "-c", PIN_IN_CHILD],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.strip()
    assert run(inherited) == "lo"  # rlbus's own pin, inherited: pinned again for this rendezvous
    assert run(users) == "eth-stale"  # the user's: kept


def test_unroutable_host_leaves_gloo_default(no_ifname: None) -> None:
    assert pin_gloo_interface("no-such-host.invalid") is None
    assert ENV_GLOO_IFNAME not in os.environ


RANK = """
import sys, torch
from datetime import timedelta
from broadcaster.gloo_iface import pin_gloo_interface
from vllm.distributed.utils import stateless_init_torch_distributed_process_group
rank, port = int(sys.argv[1]), int(sys.argv[2])
print("interface", pin_gloo_interface(sys.argv[3]), flush=True)
group = stateless_init_torch_distributed_process_group(sys.argv[3], port, rank, 2, backend="gloo",
                                                        timeout=timedelta(seconds=60))
t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
group.broadcast(t, 0).wait()
print("received", t.tolist(), flush=True)
"""


def test_gloo_group_across_network_namespaces(netns_pair: NetnsPair) -> None:
    pytest.importorskip("vllm", reason="the weight group is vLLM's stateless group")
    port = 29600
    procs = [
        subprocess.Popen(
            netns_pair.exec(ns, sys.executable, "-c", RANK, str(rank), str(port), ADDR_A),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={
                **{k: v for k, v in os.environ.items() if k not in (ENV_GLOO_IFNAME, ENV_PINNED)},
                "PYTHONPATH": str(ROOT),
            },
        )
        for rank, ns in enumerate((netns_pair.a, netns_pair.b))
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert f"interface {netns_pair.veth_a}" in outs[0] and f"interface {netns_pair.veth_b}" in outs[1], outs
    assert "received [0.0, 1.0, 2.0, 3.0]" in outs[1], outs
