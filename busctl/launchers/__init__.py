"""Launchers: how ``busctl up`` starts a component's process, and where it runs.

A launcher turns (component, command line, environment, log file) into a :class:`Launched`
handle; the supervisor judges, signals and reaps components only through handles, so healing,
scaling and shutdown are the same whatever starts the processes:

- ``local`` (:mod:`busctl.launchers.local`): a child process in its own session on this host.
- ``slurm`` (:mod:`busctl.launchers.slurm`): one ``srun`` step per component inside the
  allocation ``busctl up`` runs in; a dead step is a dead process.
- ``ray`` (:mod:`busctl.launchers.ray`): one small Ray actor per component, pinned to its node of
  a running Ray cluster, starts the process there; a dead actor or node is a dead process.

A component restarts on its node while that node lives (slurm, ray: pinned; a dead node's
components are re-planned over the live nodes, and slurm fails the run naming the node when
none is left or the job ended: :func:`check_crash`), so the addresses of ``bus.hosts`` stay
right; a binder that must move to another address moves its endpoints and restarts its peers
(:mod:`busctl.rebinding`). On several nodes a component serves its metrics on its node's
address (``RLBUS_NODE_ADDRESS``, set by the slurm and ray launchers).

Invariant: ``Launched.pid`` is what the component sends in its ready handshake and heartbeats
(its pid, or the launcher's ``RLBUS_SPAWN_ID``, :mod:`lifecycle.launch_env`).
"""

from __future__ import annotations

from typing import IO, TYPE_CHECKING, Protocol

from busctl.launchers.nodes import NodeLost

if TYPE_CHECKING:  # not at run time: busctl --help reads LAUNCHERS and stays fast
    from busctl.component_table import ComponentSpec
    from busctl.healing import Decision
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
    """Starts components (see the module docstring)."""

    name: str

    def configure(self, cfg: RunConfig) -> None:
        """Write what the launcher decides into ``cfg`` before the run's config.yaml is written
        (slurm, ray: tcp transport, per-node addresses, CurveZMQ keys)."""

    def spawn(self, spec: ComponentSpec, cmd: list[str], env: dict[str, str], log: IO[bytes]) -> Launched:
        """Start ``cmd`` for ``spec`` with ``env``, stdout and stderr to ``log``."""

    def place(self, spec: ComponentSpec) -> str:
        """Choose the node of ``spec``'s next spawn and return its address (the supervisor calls
        it just before :meth:`spawn`; ``""``: not placed by address, as the local launcher, so no
        endpoint ever moves, :mod:`busctl.rebinding`). Optional: a launcher without it is ``""``."""

    def check_crash(self, spec: ComponentSpec) -> str:
        """Called when ``spec``'s process crashed, before it is restarted: whether its node still
        lives. Returns ``""``, or a line for the console when its next spawn moves to another
        node; raises :class:`NodeLost` when it cannot run anywhere. Optional (slurm has it)."""


def check_crash(launcher: Launcher, spec: ComponentSpec, decision: Decision) -> tuple[Decision, str]:
    """The supervisor's crash ``decision`` for ``spec`` after asking ``launcher.check_crash``
    (launchers without it: unchanged): a :class:`NodeLost` turns it into a :class:`busctl.healing.FailRun`
    whose message names the node; also returns the launcher's line about a move (``""``: none)."""
    from busctl.healing import FailRun

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
