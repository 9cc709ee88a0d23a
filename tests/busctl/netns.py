"""Two "hosts" with their own addresses on this machine: network namespaces joined by a veth pair,
a Ray cluster with one node in each (for tests, as root).

:func:`netns_pair` (module scope) makes namespaces ``rlbA<tag>`` and ``rlbB<tag>`` (``tag``: unique
per test run), a veth pair ``rlb<tag>a`` (in A, :data:`ADDR_A`) / ``rlb<tag>b`` (in B,
:data:`ADDR_B`) on a /24, loopback up in each. :func:`netns_ray` then starts ``ray start --head
--node-ip-address ADDR_A`` inside A (a CPU node: hub, packer, prompt source, rewards and, with no
``trainer`` node, the trainer) and ``ray start --address ADDR_A:PORT --node-ip-address ADDR_B
--resources '{"producer": 1}'`` inside B (the inference node), one CPU each, no dashboard, the
smallest object store, their own temp dir. Everything runs in the namespaces is started through
``ip netns exec``: the namespaces share the machine's filesystem (the policy, the run directory,
Ray's shared memory) but not its network, so a component in B reaches one in A only over the veth.

Teardown kills exactly the processes inside the two namespaces (``ip netns pids``: the Ray
daemons, and anything a run left) by pid, never by name (``ray stop`` would stop every Ray
cluster on the machine), then deletes the namespaces (which removes the veth pair). Skipped, with
the reason, when not root, without ``ip``, where ``ip netns add`` is not permitted, or without
the ``ray`` package.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

ADDR_A, ADDR_B = "10.231.0.1", "10.231.0.2"
"""The two hosts' addresses (a private /24 that only the veth pair carries)."""

RAY_PORT = 6379
"""The head's GCS port, inside namespace A (no other process listens there)."""

OBJECT_STORE_BYTES = 80 * 1024 * 1024
"""Per node; Ray's minimum is 75 MiB."""

IP = shutil.which("ip", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
"""iproute2's ``ip`` (root's PATH has /usr/sbin, a plain user's may not), or None."""


@dataclass(frozen=True)
class NetnsPair:
    """The namespaces ``a``, ``b`` and their veth ends ``veth_a`` (in a), ``veth_b`` (in b)."""

    a: str
    b: str
    veth_a: str
    veth_b: str

    def exec(self, ns: str, *cmd: str) -> list[str]:
        """``cmd`` run inside namespace ``ns`` (``ip netns exec``)."""
        return [str(IP), "netns", "exec", ns, *cmd]

    def pids(self, ns: str) -> list[int]:
        """The pids of every process in namespace ``ns``."""
        out = subprocess.run([str(IP), "netns", "pids", ns], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def veth_bytes(self) -> int:
        """Bytes received plus sent on ``veth_a`` so far (its kernel counters)."""
        out = subprocess.run(
            [str(IP), "-n", self.a, "-j", "-s", "link", "show", self.veth_a], capture_output=True, text=True, check=True
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])


def _ip(*args: str) -> None:
    subprocess.run([str(IP), *args], check=True, capture_output=True, text=True)


def _kill_all(pair: NetnsPair) -> None:
    """SIGKILL every process in the two namespaces (by pid), until none is left (10 s at most)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = pair.pids(pair.a) + pair.pids(pair.b)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


@pytest.fixture(scope="module")
def netns_pair() -> Iterator[NetnsPair]:
    """Two namespaces joined by a veth pair (module docstring); removed at the end."""
    if os.geteuid() != 0:
        pytest.skip("the network-namespace test needs root (ip netns add)")
    if IP is None:
        pytest.skip("the network-namespace test needs iproute2's ip")
    tag = uuid.uuid4().hex[:6]
    pair = NetnsPair(f"rlbA{tag}", f"rlbB{tag}", f"rlb{tag}a", f"rlb{tag}b")
    made = subprocess.run([IP, "netns", "add", pair.a], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"ip netns add is not permitted here: {made.stderr.strip()}")
    try:
        _ip("netns", "add", pair.b)
        _ip("link", "add", pair.veth_a, "type", "veth", "peer", "name", pair.veth_b)
        for ns, veth, addr in ((pair.a, pair.veth_a, ADDR_A), (pair.b, pair.veth_b, ADDR_B)):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", veth, "up")
    except subprocess.CalledProcessError as err:
        subprocess.run([IP, "netns", "del", pair.a], capture_output=True)
        subprocess.run([IP, "netns", "del", pair.b], capture_output=True)
        pytest.skip(f"cannot build the veth pair between network namespaces: {err.stderr.strip()}")
    yield pair
    _kill_all(pair)
    for ns in (pair.a, pair.b):
        subprocess.run([IP, "netns", "del", ns], capture_output=True)


@pytest.fixture(scope="module")
def netns_ray(netns_pair: NetnsPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray cluster with its head in namespace A and a ``producer`` node in B; yields its address."""
    pytest.importorskip("ray", reason="the network-namespace test runs on Ray (pip install 'rlbus[ray]')")
    ray_bin = str(Path(sys.executable).with_name("ray"))
    temp_dir = Path("/tmp") / f"rlbns-{netns_pair.a[4:]}"  # short: Ray's socket paths must fit 107 bytes
    log = tmp_path_factory.mktemp("netns_ray") / "ray.out"
    common = ["--num-cpus=1", f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats"]
    address = f"{ADDR_A}:{RAY_PORT}"
    with log.open("w") as out:
        for cmd in (
            netns_pair.exec(
                netns_pair.a,
                ray_bin,
                "start",
                "--head",
                f"--node-ip-address={ADDR_A}",
                f"--port={RAY_PORT}",
                "--include-dashboard=false",
                f"--temp-dir={temp_dir}",
                *common,
            ),
            netns_pair.exec(
                netns_pair.b,
                ray_bin,
                "start",
                f"--address={address}",
                f"--node-ip-address={ADDR_B}",
                '--resources={"producer": 1}',
                *common,
            ),
        ):
            started = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=300)
            if started.returncode != 0:
                out.close()
                pytest.fail(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")
    yield address
    _kill_all(netns_pair)
    shutil.rmtree(temp_dir, ignore_errors=True)
