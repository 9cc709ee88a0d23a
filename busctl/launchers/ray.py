"""The Ray launcher: each component a process started by a small Ray actor on its node.

``busctl up --launcher ray [--address ADDR]`` connects to a running cluster and places every component on an
alive node with :func:`busctl.launchers.nodes.plan_nodes`, over the allocation the nodes' custom resources
``producer`` / ``trainer`` / ``rewards`` make (:func:`allocation_from_ray_nodes`; none: the plain plan, head
first). Each component is one :class:`ComponentActor` (``num_cpus=0``, ``num_gpus`` as planned, pinned with
``NodeAffinitySchedulingStrategy(soft=False)``) that writes ``config.yaml`` and the key files on its node and
starts the component in its own session. A dead actor or node is an exit (:data:`ACTOR_DIED`); a restart stays
on its node while that node lives (:func:`pinned_node`), else is re-planned. The policy, the Python environment
and the run's outputs still need the same paths on every node. The story is in docs/ARCHITECTURE.md, running it
in docs/operations.md, "Ray".
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import IO, Any, Callable

from lifecycle.launch_env import ENV_NODE_ADDRESS, ENV_SPAWN_ID
from busctl.components.table import ComponentSpec
from busctl.launchers.multihost import configure_multihost
from busctl.launchers.nodes import Allocation, plan_nodes
from busctl.components.placement import ENV_CUDA_DEVICES
from configs.schema import ConfigError, RunConfig

log = logging.getLogger(__name__)

ROLE_RESOURCES = ("producer", "trainer", "rewards")
"""Custom Ray resources that mark inference, trainer and CPU nodes (het groups 0, 1, 2)."""

ACTOR_DIED = -9
"""Exit code of a component whose actor (or node) died: as if SIGKILLed."""

SUSPECT_S = 60.0
"""A node where an actor died is left out of the plan this long, seconds (Ray may still list a
node that just died as alive, for up to its health-check timeout)."""


def allocation_from_ray_nodes(nodes: list[dict[str, Any]], head: str) -> Allocation:
    """The :class:`Allocation` of the alive nodes of ``ray.nodes()``; its node names are Ray node ids (hex).

    ``head`` (busctl's node) is first in the plain plan and the fallback of an empty group; the rules are in
    docs/operations.md, "Ray".

    Raises:
        ValueError: no alive node.
    """
    alive = sorted((n for n in nodes if n.get("Alive")), key=lambda n: (n["NodeID"] != head, n["NodeID"]))
    if not alive:
        raise ValueError("the Ray cluster has no alive node")
    if not any(r in n.get("Resources", {}) for n in alive for r in ROLE_RESOURCES):
        return Allocation((tuple(n["NodeID"] for n in alive),))
    fallback = head if any(n["NodeID"] == head for n in alive) else alive[0]["NodeID"]
    offers = {n["NodeID"]: set(n.get("Resources", {})) for n in alive}
    groups = [
        tuple(i for i, r in offers.items() if "producer" in r),
        tuple(i for i, r in offers.items() if "trainer" in r),
        tuple(i for i, r in offers.items() if "rewards" in r or not r & {"producer", "trainer"}),
    ]
    groups = [g or (fallback,) for g in groups]
    return Allocation(tuple(groups))


def pinned_node(alloc: Allocation, role: str, index: int, home: str | None) -> str:
    """The node of the next spawn: ``home`` while it is in ``alloc`` (alive and trusted), else planned anew."""
    alive = {n for group in alloc.groups for n in group}
    return home if home in alive else plan_nodes(alloc, role, index).node


class ComponentActor:
    """Runs one component's process on the actor's node (becomes a Ray actor in :class:`RayLauncher`)."""

    def __init__(self) -> None:
        self.popen: subprocess.Popen | None = None

    def start(
        self,
        cmd: list[str],
        env: dict[str, str],
        cwd: str,
        log_path: str,
        files: dict[str, tuple[bytes, int]],
        gpus: int,
    ) -> str:
        """Write ``files`` (path -> (content, mode); atomically, only when different), then start ``cmd`` in a new
        session, output appended to ``log_path`` after a ``===== ray node NODE_ID (ADDRESS) =====`` line; returns the
        node's address (also ``RLBUS_NODE_ADDRESS`` in its environment)."""
        import ray

        for path, (data, mode) in files.items():
            p = Path(path)
            if p.is_file() and p.read_bytes() == data:
                continue
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        if gpus:
            env = {**env, ENV_CUDA_DEVICES: ",".join(str(g) for g in ray.get_gpu_ids())}
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        address = ray.util.get_node_ip_address()
        env = {**env, ENV_NODE_ADDRESS: address}  # metrics served where the head node reaches them
        with open(log_path, "ab", buffering=0) as log:
            log.write(f"===== ray node {ray.get_runtime_context().get_node_id()} ({address}) =====\n".encode())
            self.popen = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        return address

    def poll(self) -> int | None:
        """The child's exit code if it ended, else None."""
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the child's process group; gone: ignored."""
        if self.popen is not None and self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass


class RayComponent:
    """The :class:`busctl.launchers.Launched` of one component; ``pid`` is its spawn id (``RLBUS_SPAWN_ID``)."""

    def __init__(self, actor: Any, spawn_id: int, node: str, started: Any, on_death: Callable[[str], None]) -> None:
        self.actor = actor
        self.on_death = on_death
        self.pid = spawn_id
        self.node = node
        self.address = ""
        self.returncode: int | None = None
        self._pending: Any = started
        self._started = False

    def poll(self) -> int | None:
        """The exit code once the process, its actor or its node ended, else None; never blocks (one call to the
        actor in flight, its answer read when it is there)."""
        import ray

        if self.returncode is not None:
            return self.returncode
        if self._pending is None:
            self._pending = self.actor.poll.remote()
        ready, _ = ray.wait([self._pending], timeout=0)
        if not ready:
            return None
        ref, self._pending = self._pending, None
        try:
            answer = ray.get(ref)
        except ray.exceptions.RayError as err:  # the actor or its node died (or it never started): so did the component
            log.warning(
                "ray: the actor of spawn %d on node %s ended: %s", self.pid, self.node[:12], str(err).splitlines()[0]
            )
            answer = ACTOR_DIED
            self.on_death(self.node)
        if not self._started and isinstance(answer, str):
            self._started, self.address = True, answer
            return None
        if answer is not None:
            self.returncode = answer
            ray.kill(self.actor, no_restart=True)  # its resources go back to the cluster
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"ray actor of spawn {self.pid}", timeout)
            time.sleep(0.05)
        return code

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the component's process group through its actor; ended: ignored."""
        if self.returncode is None:
            self.actor.signal.remote(sig)


class RayLauncher:
    """Starts each component through a :class:`ComponentActor` on its Ray node of the cluster at ``address``."""

    name = "ray"

    def __init__(self, address: str = "auto") -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, namespace="rlbus", log_to_driver=False, configure_logging=False)
        self.head = ray.get_runtime_context().get_node_id()
        self.head_address = ray.util.get_node_ip_address()
        self.actor_class = ray.remote(num_cpus=0)(ComponentActor)
        self.run_dir = Path(".")
        self.keys_dir = ""
        self.suspects: dict[str, float] = {}  # node id -> time.monotonic() of an actor's death there
        self.homes: dict[str, str] = {}  # component name -> node id of its last placement

    @classmethod
    def connect(cls, cfg: RunConfig, address: str = "auto") -> "RayLauncher":
        """The launcher of the Ray cluster at ``address`` (``cfg`` unused).

        Raises:
            ConfigError: the ``ray`` package is missing, or no cluster answers at ``address``.
        """
        try:
            import ray  # noqa: F401
        except ImportError:
            raise ConfigError("busctl up --launcher ray needs the ray package: pip install 'rlbus[ray]'") from None
        try:
            return cls(address)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise ConfigError(
                f"busctl up --launcher ray: cannot connect to the Ray cluster at {address!r} ({err}); "
                "start one with `ray start --head`"
            ) from None

    def nodes(self) -> tuple[Allocation, dict[str, str]]:
        """The allocation of the alive nodes now (less those suspect for :data:`SUSPECT_S`, unless that leaves
        none), and node id -> address."""
        import ray

        nodes = ray.nodes()
        now = time.monotonic()
        trusted = [n for n in nodes if now - self.suspects.get(n["NodeID"], -SUSPECT_S) >= SUSPECT_S and n.get("Alive")]
        return allocation_from_ray_nodes(trusted or nodes, self.head), {
            n["NodeID"]: n["NodeManagerAddress"] for n in nodes
        }

    def suspect(self, node: str) -> None:
        """An actor on ``node`` died: plan around the node for :data:`SUSPECT_S` seconds."""
        self.suspects[node] = time.monotonic()

    def configure(self, cfg: RunConfig) -> None:
        """Make the run multi-host (:func:`busctl.launchers.multihost.configure_multihost`)."""
        alloc, addresses = self.nodes()
        configure_multihost(cfg, alloc, lambda node: addresses.get(node, node), self.head_address, self.head)
        self.run_dir, self.keys_dir = Path(cfg.run_dir).resolve(), cfg.bus.curve_keys_dir

    def describe(self) -> str:
        """The node plan as ``#`` lines (for the console)."""
        alloc, addresses = self.nodes()
        roles = ["hub", "packer", "prompt-source", "trainer", "producer", "rewards"]
        return "\n".join(
            [f"# ray: {len(addresses)} node(s)"]
            + [
                f"#   {r}{'-0' if r in ('producer', 'rewards') else ''}: node {plan_nodes(alloc, r).node[:12]} "
                f"({addresses.get(plan_nodes(alloc, r).node)})"
                for r in roles
            ]
        )

    def place(self, spec: ComponentSpec) -> str:
        """Choose the node of ``spec``'s next spawn (:func:`pinned_node`) and return its address."""
        alloc, addresses = self.nodes()
        node = self.homes[spec.name] = pinned_node(alloc, spec.role, spec.index, self.homes.get(spec.name))
        return addresses.get(node, node)

    def files(self, address: str | None = None) -> dict[str, tuple[bytes, int]]:
        """What each actor writes on its node: ``config.yaml`` and the key files; of the metrics server keys
        (``tls/hosts/*.key``) only that of the node at ``address`` (None: all)."""
        from telemetry.certs import HOSTS_DIR, certificate_names

        out = {str(self.run_dir / "config.yaml"): ((self.run_dir / "config.yaml").read_bytes(), 0o644)}
        if self.keys_dir:
            for p in Path(self.keys_dir).resolve().rglob("*"):
                crt = p.with_suffix(".crt")
                if (
                    p.parent.name == HOSTS_DIR
                    and p.suffix == ".key"
                    and address is not None
                    and not (crt.is_file() and address in certificate_names(crt))
                ):
                    continue
                if p.is_file():
                    out[str(p)] = (p.read_bytes(), 0o600 if p.name.endswith("_secret") else 0o644)
        return out

    def spawn(self, spec: ComponentSpec, cmd: list[str], env: dict[str, str], log: IO[bytes]) -> RayComponent:
        """Start ``cmd`` through an actor on the component's node; returns at once."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        address = self.place(spec)  # as the supervisor placed it just before (unless that node died since)
        node = self.homes[spec.name]
        spawn_id = secrets.randbelow(2**31 - 2) + 1
        env = {**env, ENV_SPAWN_ID: str(spawn_id)}
        gpus = len([d for d in env.pop(ENV_CUDA_DEVICES, "").split(",") if d])  # Ray hands out the node's GPUs
        actor = self.actor_class.options(
            name=f"rlbus-{spec.name}-{spawn_id}",
            num_gpus=gpus,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        ).remote()
        files = self.files(address)  # this node's metrics server key only
        started = actor.start.remote(cmd, env, os.getcwd(), str(Path(log.name).resolve()), files, gpus)
        return RayComponent(
            actor, spawn_id, node, started, self.suspect
        )  # never waits: a failed start is an exit (poll)
