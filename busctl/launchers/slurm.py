"""The Slurm launcher: inside an allocation, one ``srun`` step per component on its node.

``busctl up --launcher slurm`` runs inside ``salloc`` or a ``busctl sbatch`` script; the nodes come from
``SLURM_JOB_NODELIST`` (or the three het groups) and :func:`busctl.launchers.nodes.plan_nodes` places each
component. :meth:`SlurmLauncher.configure` makes the run multi-host (tcp, ``bus.hosts``, per-run CurveZMQ keys
in the run directory, which every node must see). Each step's ``srun`` runs locally with a parent-death
SIGTERM, so no step outlives busctl; signals go to the step's task by ``scancel --signal``, falling back to
``srun`` when Slurm cannot say (:mod:`busctl.launchers.slurm_state`). On a crash, a job that no longer runs
fails the run; a dead node's components are re-planned over the live nodes. The story is in
docs/ARCHITECTURE.md, "Lifecycle and healing"; running it in docs/operations.md, "Slurm".
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
from typing import IO, Callable, Mapping

from lifecycle.launch_env import ENV_NODE_ADDRESS, ENV_SPAWN_ID
from busctl.components.table import ComponentSpec, signal_group
from busctl.launchers.local import LocalProcess
from busctl.launchers.multihost import configure_multihost
from busctl.launchers.nodes import HET_GROUPS, Allocation, NodeLost, Slot, plan_nodes
from busctl.launchers.slurm_state import (
    SLURM_TIMEOUT_S,
    SlurmUnavailable,
    cancel_step,
    job_state,
    node_dead,
    node_state,
    step_ids,
)
from busctl.components.placement import ENV_CUDA_DEVICES
from configs.schema import ConfigError, RunConfig
from lifecycle.parent_death import die_with_parent

log = logging.getLogger(__name__)


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


def allocation_from_environ(
    environ: Mapping[str, str], expand: Callable[[str], list[str]] = expand_nodelist
) -> Allocation:
    """The :class:`Allocation` of the job ``busctl`` runs in.

    Raises:
        ConfigError: not inside an allocation (no ``SLURM_JOB_ID`` / ``SLURM_JOB_NODELIST``), or a
            heterogeneous job without exactly the three components ``busctl sbatch`` writes.
    """
    if "SLURM_JOB_ID" not in environ or "SLURM_JOB_NODELIST" not in environ:
        raise ConfigError(
            "busctl up --launcher slurm runs inside a Slurm allocation (salloc, or a batch script from "
            "`busctl sbatch CONFIG`): SLURM_JOB_ID / SLURM_JOB_NODELIST are not set"
        )
    het = sorted(k for k in environ if k.startswith("SLURM_JOB_NODELIST_HET_GROUP_"))
    if not het:
        return Allocation((tuple(expand(environ["SLURM_JOB_NODELIST"])),))
    if len(het) != len(HET_GROUPS):
        raise ConfigError(
            f"a heterogeneous job for busctl has {len(HET_GROUPS)} components ({', '.join(HET_GROUPS)}); "
            f"this one has {len(het)} ({', '.join(het)}): write the script with `busctl sbatch`"
        )
    return Allocation(
        tuple(tuple(expand(environ[f"SLURM_JOB_NODELIST_HET_GROUP_{k}"])) for k in range(len(HET_GROUPS)))
    )


def srun_command(
    spec: ComponentSpec, cmd: list[str], node: str, het_group: int | None, gpus: int, spawn_id: int
) -> list[str]:
    """The ``srun --overlap`` line that runs ``cmd`` as one step on ``node`` (``--gpus`` as planned)."""
    return [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={node}",
        "--overlap",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        f"--job-name=rlbus-{spec.name}-{spawn_id}",
        f"--chdir={os.getcwd()}",
        *([f"--het-group={het_group}"] if het_group is not None else []),
        *([f"--gpus={gpus}"] if gpus else []),
        *cmd,
    ]


def die_with_busctl(parent_pid: int) -> Callable[[], None]:
    """A ``preexec_fn`` for ``srun``: SIGTERM when its parent thread dies (``prctl(PR_SET_PDEATHSIG)``, Linux);
    a parent gone before the ``prctl`` is caught by comparing ``getppid()`` with ``parent_pid``."""

    def arm() -> None:
        die_with_parent(signal.SIGTERM)
        if os.getppid() != parent_pid:
            os.kill(os.getpid(), signal.SIGTERM)

    return arm


class SlurmStep(LocalProcess):
    """The :class:`busctl.launchers.Launched` of one ``srun`` step: the local ``srun``'s exit is the step's;
    ``pid`` is the spawn id (``RLBUS_SPAWN_ID``) the component names itself by. ``job`` None: any job's step."""

    def __init__(
        self, popen: subprocess.Popen, spawn_id: int, node: str, step_name: str, job: str | None = None
    ) -> None:
        super().__init__(popen, node)
        self.pid = spawn_id
        self.step_name = step_name
        self.job = job

    def step_ids(self) -> list[str]:
        """The Slurm ids (``JOB.STEP``) of this component's step (empty once it ended).

        Raises:
            busctl.launchers.slurm_state.SlurmUnavailable: ``squeue`` failed every try (unknown).
        """
        return step_ids(self.step_name, self.job)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the step's task with ``scancel --signal``: ``srun`` would answer SIGTERM by cancelling
        the step and cut a graceful stop short. ``srun`` gets ``sig`` too on SIGKILL, when the step is not listed, or
        when Slurm cannot say or ``scancel`` fails (``srun`` then cancels the step). Gone: ignored."""
        if self.popen.poll() is not None:
            return
        fallback = sig == signal.SIGKILL
        try:
            steps = self.step_ids()
            fallback = fallback or not steps
            for step in steps:
                cancel_step(step, signal.Signals(sig).name.removeprefix("SIG"))
        except SlurmUnavailable as err:
            log.warning(
                "%s of %s: %s; signalling its srun (pid %d) instead",
                signal.Signals(sig).name,
                self.step_name,
                err,
                self.popen.pid,
            )
            fallback = True
        if fallback:
            signal_group(self.popen.pid, sig)


class SlurmLauncher:
    """Starts each component as an ``srun`` step on its node of ``alloc``; ``resolve``: node name -> address,
    ``job``: ``SLURM_JOB_ID`` (None: its state is not checked on a crash).

    Attributes:
        dead: nodes found dead (:meth:`check_crash`); nothing is placed on them again.
        pinned: component name -> its :class:`Slot` (the node of its last spawn).
    """

    name = "slurm"

    def __init__(
        self, alloc: Allocation, resolve: Callable[[str], str] = socket.gethostbyname, job: str | None = None
    ) -> None:
        self.alloc = alloc
        self.resolve = resolve
        self.job = job
        self.dead: set[str] = set()
        self.pinned: dict[str, Slot] = {}

    @classmethod
    def from_environ(cls, cfg: RunConfig, environ: Mapping[str, str] | None = None) -> "SlurmLauncher":
        """The launcher of the allocation busctl runs in (``cfg`` unused); ConfigError outside one."""
        try:
            environ = os.environ if environ is None else environ
            return cls(allocation_from_environ(environ), job=environ.get("SLURM_JOB_ID"))
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def configure(self, cfg: RunConfig) -> None:
        """Make the run multi-host (:func:`busctl.launchers.multihost.configure_multihost`)."""
        configure_multihost(cfg, self.alloc, self.resolve, socket.gethostname(), socket.gethostname().split(".")[0])

    def describe(self) -> str:
        """The node plan as ``#`` lines (for the console and ``--dry-run``)."""
        roles = ["hub", "packer", "prompt-source", "trainer", "producer", "rewards"]
        return "\n".join(
            [f"# slurm: nodes {[list(g) for g in self.alloc.groups]}"]
            + [
                f"#   {r}{'-0' if r in ('producer', 'rewards') else ''}: {plan_nodes(self.alloc, r).node}"
                for r in roles
            ]
        )

    def live_allocation(self) -> Allocation:
        """:attr:`alloc` without the :attr:`dead` nodes.

        Raises:
            NodeLost: a group (the whole job, or a het component) has no live node left.
        """
        groups = tuple(tuple(n for n in g if n not in self.dead) for g in self.alloc.groups)
        for k, (group, live) in enumerate(zip(self.alloc.groups, groups)):
            if not live:
                what = f"het group {k} ({HET_GROUPS[k]})" if self.alloc.heterogeneous else "the allocation"
                raise NodeLost(
                    f"node {', '.join(sorted(self.dead & set(group)))} of {what} is down and {what} has no "
                    f"live node left to place its components on"
                )
        return Allocation(groups)

    def slot(self, spec: ComponentSpec) -> Slot:
        """Where ``spec`` runs next: its last node while it lives, else re-planned over the live nodes (NodeLost)."""
        slot = self.pinned.get(spec.name)
        if slot is None or slot.node in self.dead:
            slot = self.pinned[spec.name] = plan_nodes(self.live_allocation(), spec.role, spec.index)
        return slot

    def place(self, spec: ComponentSpec) -> str:
        """The address of ``spec``'s node (:meth:`slot`: the same node while it lives)."""
        return self.resolve(self.slot(spec).node)

    def check_crash(self, spec: ComponentSpec) -> str:
        """After ``spec``'s step ended unasked: a dead node with a spare moves ``spec`` there (returns the line
        saying so); else ``""``, also when Slurm does not answer (logged; the restart goes ahead).

        Raises:
            NodeLost: the job no longer runs, or the node is dead with no live node left (naming the node).
        """
        node = self.pinned[spec.name].node if spec.name in self.pinned else self.slot(spec).node
        try:
            state = job_state(self.job) if self.job is not None else "RUNNING"
            if state != "RUNNING":
                try:
                    node_says = "+".join(sorted(node_state(node, tries=1)))
                except SlurmUnavailable:
                    node_says = "state unknown"
                raise NodeLost(
                    f"Slurm job {self.job} is {state} (node {node} of {spec.name}: {node_says}): "
                    "the allocation is gone, no component can be restarted"
                )
            states = node_state(node)
        except SlurmUnavailable as err:
            log.warning("cannot check node %s of %s: %s", node, spec.name, err)
            return ""
        if not node_dead(states):
            return ""
        self.dead.add(node)
        moved = self.slot(spec)  # NodeLost when no live node is left
        return f"node {node} of {spec.name} is {'+'.join(sorted(states))}: {spec.name} moves to {moved.node}"

    def spawn(self, spec: ComponentSpec, cmd: list[str], env: dict[str, str], log: IO[bytes]) -> SlurmStep:
        """Start ``cmd`` as an ``srun`` step on the component's node; Slurm hands out its GPUs."""
        slot = self.slot(spec)
        spawn_id = secrets.randbelow(2**31 - 2) + 1
        env = {**env, ENV_SPAWN_ID: str(spawn_id), ENV_NODE_ADDRESS: self.resolve(slot.node)}
        devices = [d for d in env.get(ENV_CUDA_DEVICES, "").split(",") if d]
        if devices:  # Slurm hands out (and numbers) the node's GPUs itself
            del env[ENV_CUDA_DEVICES]
        step = srun_command(spec, cmd, slot.node, slot.het_group, len(devices), spawn_id)
        popen = subprocess.Popen(
            step,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=os.getcwd(),
            start_new_session=True,
            preexec_fn=die_with_busctl(os.getpid()),
        )
        return SlurmStep(popen, spawn_id, slot.node, f"rlbus-{spec.name}-{spawn_id}", self.job)
