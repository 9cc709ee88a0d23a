"""The component table of a run and the small process facts the supervisor judges it by.

:func:`component_table` lists every process of a run in start order; a :class:`ComponentSpec` is one row with
its runtime state. The helpers (exit descriptions, process start times, free ports) carry no supervisor state.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from broadcaster.factory import needs_rendezvous_port
from configs.schema import RunConfig

RESTARTABLE_ROLES = frozenset({"hub", "trainer", "rewards", "producer", "prompt-source", "packer", "serve"})
"""Roles the supervisor restarts: every role (the packer rebuilds its state from its spool)."""


class ComponentState(StrEnum):
    """The state of a component in the supervisor's table, as ``status.json``, ``busctl status`` and the live
    display show it."""

    NOT_STARTED = "not started"
    STARTING = "starting"
    """Spawned; its ready handshake is due by ``bus.ready_timeout_s``."""
    READY = "ready"
    """Ready handshake received; no heartbeat since."""
    RUNNING = "running"
    """Heartbeats arrive."""
    DONE = "done"
    """Its heartbeats say its work for the run is done (it still serves metrics)."""
    RESTARTING = "restarting"
    """Crashed; spawned again when its backoff runs out."""
    STOPPING = "stopping"
    """Being scaled away (SIGTERM sent, SIGKILL at its deadline)."""
    EXITED = "exited"
    """Gone for good: scaled away, or its crash failed the run."""


LIVE_STATES = (ComponentState.READY, ComponentState.RUNNING, ComponentState.DONE)
"""States of a component that completed its ready handshake and is alive."""


@dataclass
class ComponentSpec:
    """One row of the component table, with its runtime state.

    Attributes:
        name: unique name (``"rewards-1"``); its role is the name without the ``-INDEX`` suffix.
        metrics_host: where it serves metrics, from its ready handshake (127.0.0.1, or its node's address).
        port_request: metrics port asked for at spawn (0: any). proc: its :class:`busctl.launchers.Launched`.
        spawned_at, ready_at, last_beat: ``time.monotonic()`` of the last spawn, handshake and heartbeat.
        due: monotonic deadline of the current state (ready timeout, respawn time or SIGKILL time).
    """

    name: str
    module: str
    index: int = 0
    pid: int = 0
    state: ComponentState = ComponentState.NOT_STARTED
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    restarts: int = 0
    consecutive_crashes: int = 0
    exit_code: int | None = None
    last_error: str = ""
    late_join: bool = False
    port_request: int = 0
    spawned_at: float = 0.0
    ready_at: float | None = None
    last_beat: float | None = None
    last_beat_wall: float | None = None
    due: float = 0.0
    proc: Any = field(default=None, repr=False, compare=False)

    @property
    def role(self) -> str:
        """``"rewards"`` for ``"rewards-1"``, ``"producer"`` for ``"producer-0"``, else the name."""
        base, _, suffix = self.name.rpartition("-")
        return base if base and suffix.isdigit() else self.name

    def status_row(self) -> dict:
        """The JSON row of ``status.json``."""
        return {
            "name": self.name,
            "module": self.module,
            "index": self.index,
            "pid": self.pid,
            "state": self.state,
            "metrics_port": self.metrics_port,
            "metrics_host": self.metrics_host,
            "restarts": self.restarts,
            "consecutive_crashes": self.consecutive_crashes,
            "last_heartbeat_at": self.last_beat_wall,
            "exit_code": self.exit_code,
            "last_error": self.last_error,
            "late_join": self.late_join,
        }


def component_table(cfg: RunConfig) -> list[ComponentSpec]:
    """Every process of a run, in start order (the hub first, the prompt source last); no trainer
    with ``eval.only`` (``busctl eval``); with ``serve.only`` (``busctl serve``) the hub, the API trainer, its
    samplers and the API process."""
    if cfg.serve.only:
        samplers = [ComponentSpec(f"producer-{i}", "producers.api_proc", i) for i in range(cfg.serve.samplers)]
        return [
            ComponentSpec("hub", "bus.hub"),
            ComponentSpec("trainer", "trainer.api.proc"),
            *samplers,
            ComponentSpec("serve", "service.proc"),
        ]
    table = [
        ComponentSpec("hub", "bus.hub"),
        ComponentSpec("trainer", "trainer.proc"),
        ComponentSpec("packer", "packer.proc"),
    ]
    if cfg.eval.only:
        table = [spec for spec in table if spec.role != "trainer"]
    table += [ComponentSpec(f"rewards-{i}", "rewards.proc", i) for i in range(cfg.rewards.replicas)]
    table += [ComponentSpec(f"producer-{i}", "producers.proc", i) for i in range(cfg.producers.replicas)]
    table.append(ComponentSpec("prompt-source", "prompts.proc"))
    return table


def launch_prefix(cfg: RunConfig, spec: ComponentSpec) -> list[str]:
    """The start of a component's command line: ``python -m MODULE``, or for a trainer with ``data_parallel`` N > 1
    ``python -m torch.distributed.run --standalone --nproc-per-node N -m MODULE``.

    The torchrun group is one component: the supervisor watches, kills and restarts the agent; its ranks die with it
    and rank 0 sends the handshake and heartbeats in the agent's name.
    """
    n = cfg.trainer.data_parallel
    if spec.role != "trainer" or n == 1:
        return [sys.executable, "-m", spec.module]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        "-m",
        spec.module,
    ]


def describe_exit(code: int) -> str:
    """``"exited with code 1"`` or ``"was killed by SIGKILL"`` (Popen's negative codes)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def process_start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22), to
    tell a process from a later one that reuses its pid; None if unknown or not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        return int(stat.rpartition(")")[2].split()[19])
    except (IndexError, ValueError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def claim_broadcast_port(cfg: RunConfig) -> None:
    """Give the weight transfer a free rendezvous port when it needs one and the config leaves it
    open (``broadcast.port: 0``; the method answers: :func:`broadcaster.factory.needs_rendezvous_port`);
    changes ``cfg`` in place."""
    if needs_rendezvous_port(cfg.broadcast):
        cfg.broadcast.port = free_port(cfg.broadcast.host)


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to process group ``pgid``; a group that is gone (or not ours) is ignored."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
