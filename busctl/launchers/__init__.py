"""Launchers: how ``busctl up`` starts a component's process, and where it runs.

A launcher turns (component, command line, environment, log file) into a :class:`Launched` handle; the
supervisor judges, signals and reaps components only through handles, so healing, scaling and shutdown are the
same whatever starts the processes: ``local`` (a child in its own session), ``slurm`` (an ``srun`` step per
component) or ``ray`` (a pinned Ray actor per component). A component restarts on its node while that node
lives, so ``bus.hosts`` stays right. Invariant: ``Launched.pid`` is what the component sends in its handshake
and heartbeats (its pid, or the launcher's ``RLBUS_SPAWN_ID``).
"""

from __future__ import annotations

from typing import IO, TYPE_CHECKING, Protocol

from busctl.launchers.nodes import NodeLost

if TYPE_CHECKING:  # not at run time: busctl --help reads LAUNCHERS and stays fast
    from busctl.components.table import ComponentSpec
    from busctl.components.healing import Decision
    from configs.schema import RunConfig

LAUNCHERS = ("local", "slurm", "ray")
"""The launcher names (``supervisor.launcher``, ``busctl up --launcher``)."""


class Launched(Protocol):
    """A started component: its process (local), its ``srun`` step, or its Ray actor's process.

    Attributes:
        pid: the id the supervisor matches the component's handshakes against.
        node: the host it runs on (ray: the Ray node id).
        returncode: exit code once it ended (negative: killed by that signal), else None.
    """

    pid: int
    node: str
    returncode: int | None

    def poll(self) -> int | None:
        """The exit code if it ended, else None (never blocks)."""

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end; raises ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the whole component (process group, or srun step); gone: ignored."""


class Launcher(Protocol):
    """Starts components."""

    name: str

    def configure(self, cfg: RunConfig) -> None:
        """Write what the launcher decides (slurm, ray: tcp, per-node addresses, keys) into ``cfg``."""

    def spawn(self, spec: ComponentSpec, cmd: list[str], env: dict[str, str], log: IO[bytes]) -> Launched:
        """Start ``cmd`` for ``spec`` with ``env``, stdout and stderr to ``log``."""

    def place(self, spec: ComponentSpec) -> str:
        """Choose the node of ``spec``'s next spawn and return its address, just before :meth:`spawn`. Optional: a
        launcher without it (``""``, as local) never moves an endpoint."""

    def check_crash(self, spec: ComponentSpec) -> str:
        """After ``spec``'s process crashed, before its restart: ``""``, or a console line when its next spawn moves
        to another node; :class:`NodeLost` when it cannot run anywhere. Optional (slurm has it)."""


def check_crash(launcher: Launcher, spec: ComponentSpec, decision: Decision) -> tuple[Decision, str]:
    """The supervisor's crash ``decision`` for ``spec`` after ``launcher.check_crash``: a :class:`NodeLost` makes it
    a :class:`busctl.components.healing.FailRun` naming the node; also the launcher's line about a move
    (``""``: none)."""
    from busctl.components.healing import FailRun

    try:
        return decision, getattr(launcher, "check_crash", lambda _spec: "")(spec)
    except NodeLost as err:
        reason = getattr(decision, "reason", "crashed")
        return FailRun(spec.name, reason, f"{spec.name} {reason}: {err}"), ""


def make_launcher(cfg: RunConfig) -> Launcher:
    """The launcher ``cfg.supervisor.launcher`` names.

    Raises:
        ValueError: an unknown name. configs.schema.ConfigError: (slurm) not inside an allocation;
            (ray) no ``ray`` package, or no cluster at ``supervisor.ray_address``.
    """
    name = cfg.supervisor.launcher
    if name == "local":
        from busctl.launchers.local import LocalLauncher

        return LocalLauncher()
    if name == "slurm":
        from busctl.launchers.slurm import SlurmLauncher

        return SlurmLauncher.from_environ(cfg)
    if name == "ray":
        from busctl.launchers.ray import RayLauncher

        return RayLauncher.connect(cfg, cfg.supervisor.ray_address)
    raise ValueError(f"supervisor.launcher must be one of {LAUNCHERS}, got {name!r}")
