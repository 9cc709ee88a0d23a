"""A real one-node Slurm cluster on this machine, for tests: munged + slurmctld + slurmd.

:func:`start_cluster` starts Debian's ``slurm-wlm`` daemons (it installs nothing) with a generated
``slurm.conf``: one node (this host, its CPUs and memory), ``SelectType=select/cons_tres``,
``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``, no accounting; a private munge
key, socket, state and spool directories under the given directory, and free ports, so it
disturbs no Slurm or munge already on the host. Clients (``srun``, ``salloc``, ``sbatch``,
``scontrol``) find it through ``SLURM_CONF`` (:attr:`SlurmCluster.environ`).

The fixture :func:`slurm_cluster` (module scope: the daemons are gone before the next test module,
whose leftover-process checks would see them as its own children) skips, with the reason, when the daemons are not
installed (``make test`` installs them as root: ``make slurm``), when not root, or when they do
not come up within :data:`UP_TIMEOUT_S`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

UP_TIMEOUT_S = 60.0
"""Longest wait for the node to be ``idle`` after the daemons start, seconds."""

DAEMONS = ("munged", "slurmctld", "slurmd")

SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
"""Where the daemons are looked up (Debian installs them in /usr/sbin, not always on PATH)."""


def daemon(name: str) -> str | None:
    """The daemon's path, or None when it is not installed."""
    return shutil.which(name, path=SBIN_PATH)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _memory_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 - 512  # leave slurmd's RealMemory check some slack
    raise RuntimeError("no MemTotal in /proc/meminfo")


@dataclass
class SlurmCluster:
    """A running one-node cluster.

    Attributes:
        root: its directory (config, state, spool, logs). conf: its ``slurm.conf``.
        node: the node name (this host's short name). cpus: its CPUs.
        procs: the daemons, in start order.
    """

    root: Path
    conf: Path
    node: str
    cpus: int
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def environ(self) -> dict[str, str]:
        """``os.environ`` plus ``SLURM_CONF``: what a Slurm client of this cluster needs."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def logs(self) -> str:
        """The daemons' logs (for a failure message)."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        """Stop the daemons and what they started (each daemon's whole session: slurmctld's
        slurmscriptd, slurmd's step daemons): SIGTERM, then SIGKILL after 10 s; then SIGKILL
        every ``slurmstepd`` of this cluster left (they leave slurmd's session, and one still
        retrying its step-completion message would wait for a slurmctld that is gone)."""
        for proc in reversed(self.procs):
            _signal_session(proc, signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            _signal_session(proc, signal.SIGKILL)
            proc.wait()
        self.procs.clear()
        for pid in self.step_daemons():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def step_daemons(self) -> list[int]:
        """Pids of the running ``slurmstepd`` processes of this cluster (``SLURM_CONF`` in their environment)."""
        mine = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if (proc / "comm").read_text().strip() == "slurmstepd" and mine in (
                    proc / "environ"
                ).read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:  # gone, or not ours to read
                pass
        return pids


def _signal_session(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group of ``proc`` (started with ``start_new_session``)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def slurm_conf(root: Path, node: str, cpus: int, memory_mib: int, ctld_port: int, slurmd_port: int) -> str:
    """The ``slurm.conf`` text of a one-node cluster rooted at ``root`` (see the module docstring)."""
    return "\n".join(
        [
            "ClusterName=rlbustest",
            f"SlurmctldHost={node}",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge.socket",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool",
            f"SlurmctldPidFile={root}/slurmctld.pid",
            f"SlurmdPidFile={root}/slurmd.pid",
            f"SlurmctldLogFile={root}/slurmctld.log",
            f"SlurmdLogFile={root}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "ReturnToService=2",
            "MpiDefault=none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "KillWait=5",
            f"NodeName={node} CPUs={cpus} RealMemory={memory_mib} State=UNKNOWN",
            f"PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
            "",
        ]
    )


def start_cluster(root: Path) -> SlurmCluster:
    """Start munged, slurmctld and slurmd under ``root`` and wait until the node is idle.

    Raises:
        RuntimeError: a daemon exited, or the node was not idle within :data:`UP_TIMEOUT_S`
            (the message holds the daemons' logs); the daemons started are stopped first.
    """
    node, cpus = socket.gethostname().split(".")[0], os.cpu_count() or 1
    root.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool"):
        (root / sub).mkdir(exist_ok=True)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, node, cpus, _memory_mib(), _free_port(), _free_port()))
    cluster = SlurmCluster(root, conf, node, cpus)
    env = cluster.environ
    commands = [
        [
            daemon("munged"),
            "--foreground",
            "--force",
            f"--socket={root}/munge.socket",
            f"--key-file={key}",
            f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log",
            f"--seed-file={root}/munged.seed",
        ],
        [daemon("slurmctld"), "-D", "-i", "-f", str(conf)],
        [daemon("slurmd"), "-D", "-f", str(conf), "-N", node],
    ]
    try:
        for cmd in commands:
            with open(root / f"{Path(cmd[0]).name}.out", "ab") as out:
                cluster.procs.append(
                    subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                )
            time.sleep(0.5)  # slurmctld needs munged's socket, slurmd needs slurmctld
        deadline = time.monotonic() + UP_TIMEOUT_S
        while time.monotonic() < deadline:
            dead = [Path(p.args[0]).name for p in cluster.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited at start")
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
            if out.stdout.strip() == "idle":
                return cluster
            time.sleep(1.0)
        raise RuntimeError(f"node {node} not idle within {UP_TIMEOUT_S:.0f} s")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        logs = cluster.logs()
        cluster.stop()
        raise RuntimeError(f"{err}\n{logs}") from None


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory):
    """A running one-node Slurm cluster (:class:`SlurmCluster`); skips where there can be none."""
    missing = [d for d in (*DAEMONS, "srun", "salloc", "sbatch") if daemon(d) is None]
    if missing:
        pytest.skip(
            f"Slurm is not installed ({', '.join(missing)} missing): as root, `make slurm` "
            "(apt-get install -y slurm-wlm munge)"
        )
    if os.geteuid() != 0:
        pytest.skip("the test Slurm cluster runs its daemons as root (SlurmUser=root); not root here")
    root = tmp_path_factory.mktemp("slurm", numbered=True)
    if len(str(root / "munge.socket")) > 100:
        root = Path(f"/tmp/rlbus-slurm-{os.getpid()}")
    try:
        cluster = start_cluster(root)
    except RuntimeError as err:
        pytest.skip(f"the Slurm daemons did not come up: {err}")
    yield cluster
    cluster.stop()
