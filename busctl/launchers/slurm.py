"""The Slurm launcher: inside an allocation, one ``srun`` step per component on its node.

``busctl up --launcher slurm`` runs inside ``salloc`` or a batch script (``busctl sbatch``). The
nodes come from ``SLURM_JOB_NODELIST`` (a heterogeneous job: ``SLURM_JOB_NODELIST_HET_GROUP_0..2``),
expanded by ``scontrol show hostnames``; :func:`busctl.launchers.nodes.plan_nodes` puts each
component on a node. :meth:`SlurmLauncher.configure` then makes the run multi-host: transport
tcp with ``bus.hosts`` naming the node that binds each endpoint, the weight broadcast's
rendezvous at the trainer's node, and (unless ``bus.curve_keys_dir`` is given) a fresh CurveZMQ
key directory ``RUN_DIR/curve_keys`` made for this run (mode 0700; components read it, like
``config.yaml``, from the run directory, which must be on a filesystem every node sees, as
Slurm clusters have).

Each component is ``srun --nodes=1 --ntasks=1 --nodelist=NODE --overlap [--het-group=K]
[--gpus=N] --kill-on-bad-exit=1 --job-name=rlbus-NAME-ID CMD``, started locally in its own
session; GPU components get ``--gpus`` with as many devices as :mod:`busctl.placement` planned
and Slurm sets their ``CUDA_VISIBLE_DEVICES``. The step's component sends ``RLBUS_SPAWN_ID=ID``
instead of its pid (it runs elsewhere) and serves its metrics on its node's address
(``RLBUS_NODE_ADDRESS``, the node resolved as for ``bus.hosts``), which ``prometheus.yml`` and
``busctl status`` read (:mod:`busctl.metrics_targets`). The supervisor watches the local ``srun``: the step's
end is its exit. Signals go to the step's task with ``scancel --signal=SIG`` (the step found by
its name): SIGTERM is a graceful stop as on the local launcher (``srun`` itself would answer
SIGTERM by cancelling the step, SIGKILL after ``KillWait``); SIGKILL also kills ``srun``, so a
killed component leaves nothing running on its node.

A component is always placed on the node of its first start (the allocation is fixed), so a
binding component's address in ``bus.hosts`` stays right across restarts; a node that fails makes
its components fail until ``supervisor.max_restarts`` ends the run.

Not covered: busctl itself SIGKILLed leaves its steps running until the allocation ends.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
from typing import IO, Callable, Mapping

from bus.launch_env import ENV_NODE_ADDRESS, ENV_SPAWN_ID
from busctl.component_table import ComponentSpec, signal_group
from busctl.launchers.local import LocalProcess
from busctl.launchers.multihost import configure_multihost
from busctl.launchers.nodes import HET_GROUPS, Allocation, plan_nodes
from busctl.placement import ENV_CUDA_DEVICES
from configs.schema import ConfigError, RunConfig

log = logging.getLogger(__name__)

SLURM_TIMEOUT_S = 30.0
"""Longest wait for ``scontrol`` / ``squeue`` / ``scancel``, seconds."""

def expand_nodelist(nodelist: str, run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> list[str]:
    """Host names of a Slurm node list (``"gpu[01-03],cpu1"``), by ``scontrol show hostnames``.

    Raises:
        ValueError: an empty list, or scontrol failed (its message is included).
    """
    if not nodelist.strip():
        raise ValueError("empty Slurm node list")
    out = run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    names = out.stdout.split()
    if out.returncode != 0 or not names:
        raise ValueError(f"scontrol show hostnames {nodelist!r} failed: {out.stderr.strip() or 'no hosts'}")
    return names


def allocation_from_environ(environ: Mapping[str, str], expand: Callable[[str], list[str]] = expand_nodelist) -> Allocation:
    """The :class:`Allocation` of the job ``busctl`` runs in.

    Raises:
        ConfigError: not inside an allocation (no ``SLURM_JOB_ID`` / ``SLURM_JOB_NODELIST``), or a
            heterogeneous job without exactly the three components ``busctl sbatch`` writes.
    """
    if "SLURM_JOB_ID" not in environ or "SLURM_JOB_NODELIST" not in environ:
        raise ConfigError("busctl up --launcher slurm runs inside a Slurm allocation (salloc, or a batch script from "
                          "`busctl sbatch CONFIG`): SLURM_JOB_ID / SLURM_JOB_NODELIST are not set")
    het = sorted(k for k in environ if k.startswith("SLURM_JOB_NODELIST_HET_GROUP_"))
    if not het:
        return Allocation((tuple(expand(environ["SLURM_JOB_NODELIST"])),))
    if len(het) != len(HET_GROUPS):
        raise ConfigError(f"a heterogeneous job for busctl has {len(HET_GROUPS)} components ({', '.join(HET_GROUPS)}); "
                          f"this one has {len(het)} ({', '.join(het)}): write the script with `busctl sbatch`")
    return Allocation(tuple(tuple(expand(environ[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"])) for k in range(len(HET_GROUPS))))


def srun_command(spec: ComponentSpec, cmd: list[str], node: str, het_group: int | None, gpus: int, spawn_id: int) -> list[str]:
    """The ``srun`` line that runs ``cmd`` as one step on ``node`` (see the module docstring)."""
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={node}", "--overlap", "--kill-on-bad-exit=1", "--export=ALL",
            f"--job-name=rlbus-{spec.name}-{spawn_id}", f"--chdir={os.getcwd()}",
            *([f"--het-group={het_group}"] if het_group is not None else []), *([f"--gpus={gpus}"] if gpus else []), *cmd]


class SlurmStep(LocalProcess):
    """:class:`busctl.launchers.Launched` of one ``srun`` step (see the module docstring): the local
    ``srun`` process's exit is the step's; ``pid`` is the spawn id the component names itself by."""

    def __init__(self, popen: subprocess.Popen, spawn_id: int, node: str, step_name: str) -> None:
        super().__init__(popen, node)
        self.pid = spawn_id
        self.step_name = step_name

    def step_ids(self) -> list[str]:
        """The Slurm ids (``JOB.STEP``) of this component's step (none once it ended)."""
        out = subprocess.run(["squeue", "--steps", "--noheader", "--format=%i %j"], capture_output=True, text=True,
                             timeout=SLURM_TIMEOUT_S)
        return [line.split()[0] for line in out.stdout.splitlines() if line.split()[1:] == [self.step_name]]

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the step's task with ``scancel --signal`` (not to ``srun``: ``srun``
        answers SIGTERM by cancelling the step, SIGKILL after Slurm's ``KillWait``, which would cut
        a graceful stop short); after SIGKILL, or when the step is not found, ``srun`` too
        (its whole process group). Gone: ignored."""
        if self.popen.poll() is not None:
            return
        try:
            steps = self.step_ids()
            for step in steps:
                subprocess.run(["scancel", f"--signal={signal.Signals(sig).name.removeprefix('SIG')}", step],
                               capture_output=True, timeout=SLURM_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            log.warning("scancel of %s failed (%s); signalling its srun", self.step_name, err)
            steps = []
        if sig == signal.SIGKILL or not steps:
            signal_group(self.popen.pid, sig)


class SlurmLauncher:
    """Starts each component as an ``srun`` step on its node of ``alloc``.

    Args:
        alloc: the job's nodes. resolve: node name -> address for ``bus.hosts``.
    """

    name = "slurm"

    def __init__(self, alloc: Allocation, resolve: Callable[[str], str] = socket.gethostbyname) -> None:
        self.alloc = alloc
        self.resolve = resolve

    @classmethod
    def from_environ(cls, cfg: RunConfig, environ: Mapping[str, str] | None = None) -> "SlurmLauncher":
        """The launcher of the allocation busctl runs in (``cfg``: unused, for symmetry).

        Raises:
            ConfigError: see :func:`allocation_from_environ`.
        """
        try:
            return cls(allocation_from_environ(os.environ if environ is None else environ))
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def configure(self, cfg: RunConfig) -> None:
        """tcp, ``bus.hosts``, the broadcast rendezvous at the trainer's node, per-run CurveZMQ keys
        (:func:`busctl.launchers.multihost.configure_multihost`)."""
        configure_multihost(cfg, self.alloc, self.resolve, socket.gethostname(), socket.gethostname().split(".")[0])

    def describe(self) -> str:
        """The node plan as ``#`` lines (for the console and ``--dry-run``)."""
        roles = ["hub", "packer", "prompt-source", "trainer", "producer", "rewards"]
        return "\n".join([f"# slurm: nodes {[list(g) for g in self.alloc.groups]}"] +
                         [f"#   {r}{'-0' if r in ('producer', 'rewards') else ''}: {plan_nodes(self.alloc, r).node}" for r in roles])

    def place(self, spec: ComponentSpec) -> str:
        """The address of ``spec``'s node: always the same node for a component (the allocation is fixed)."""
        return self.resolve(plan_nodes(self.alloc, spec.role, spec.index).node)

    def spawn(self, spec: ComponentSpec, cmd: list[str], env: dict[str, str], log: IO[bytes]) -> SlurmStep:
        """Start ``cmd`` as an ``srun`` step on the component's node (module docstring)."""
        slot = plan_nodes(self.alloc, spec.role, spec.index)
        spawn_id = secrets.randbelow(2**31 - 2) + 1
        env = {**env, ENV_SPAWN_ID: str(spawn_id), ENV_NODE_ADDRESS: self.resolve(slot.node)}
        devices = [d for d in env.get(ENV_CUDA_DEVICES, "").split(",") if d]
        if devices:  # Slurm hands out (and numbers) the node's GPUs itself
            del env[ENV_CUDA_DEVICES]
        step = srun_command(spec, cmd, slot.node, slot.het_group, len(devices), spawn_id)
        popen = subprocess.Popen(step, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                 cwd=os.getcwd(), start_new_session=True)
        return SlurmStep(popen, spawn_id, slot.node, f"rlbus-{spec.name}-{spawn_id}")
