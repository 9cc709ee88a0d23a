"""The local launcher: every component a child process of ``busctl up`` on this host.

Each component is started with ``subprocess.Popen`` in its own session (so its process group,
vLLM's engine processes included, can be signalled as one), stdin from /dev/null, stdout and
stderr to its log, in busctl's working directory: exactly what the supervisor always did.
"""

from __future__ import annotations

import os
import socket
import subprocess
from typing import IO

from lifecycle.launch_env import ENV_NODE_ADDRESS, ENV_SPAWN_ID
from busctl.components.table import ComponentSpec, signal_group
from configs.schema import RunConfig


class LocalProcess:
    """:class:`busctl.launchers.Launched` of a local child process (wraps its ``Popen``)."""

    def __init__(self, popen: subprocess.Popen, node: str) -> None:
        self.popen = popen
        self.pid = popen.pid
        self.node = node

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: signal), or None while it runs."""
        return self.popen.returncode

    def poll(self) -> int | None:
        """The exit code if it ended, else None."""
        return self.popen.poll()

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        return self.popen.wait(timeout=timeout)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to its process group (it leads one); a gone group is ignored."""
        signal_group(self.pid, sig)


class LocalLauncher:
    """Starts components as local processes (the default ``supervisor.launcher``). ``node_address``: this host's
    address as other hosts reach it; given, components serve metrics there and :meth:`place` returns it (``""``:
    a single-host run, metrics on 127.0.0.1)."""

    name = "local"

    def __init__(self, node_address: str = "") -> None:
        self.node_address = node_address

    def configure(self, cfg: RunConfig) -> None:
        """Nothing to decide: the config's transport and addresses stand."""

    def place(self, spec: ComponentSpec) -> str:
        """:attr:`node_address` (``""``: every component runs on this host at the addresses the
        config gives, nothing moves)."""
        return self.node_address

    def spawn(self, spec: ComponentSpec, cmd: list[str], env: dict[str, str], log: IO[bytes]) -> LocalProcess:
        """``Popen(cmd)`` in a new session, output to ``log`` (an inherited ``RLBUS_SPAWN_ID`` or
        ``RLBUS_NODE_ADDRESS`` removed: the component names itself by its pid and serves its
        metrics on 127.0.0.1, or at :attr:`node_address` when set)."""
        env = {k: v for k, v in env.items() if k not in (ENV_SPAWN_ID, ENV_NODE_ADDRESS)}
        if self.node_address:
            env[ENV_NODE_ADDRESS] = self.node_address
        popen = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=os.getcwd(),
            start_new_session=True,
        )
        return LocalProcess(popen, socket.gethostname())
