"""The launch environment: what the supervisor tells a component about this start of it.

``busctl up`` starts every component as a fresh process; three environment variables say how this
start differs from the first one of a fresh run:

- ``RLBUS_RESTARTS=<n>``: the supervisor restarted this component for the n-th time (n >= 1;
  unset or empty: 0).
- ``RLBUS_RESUME=1``: the run was started with ``busctl up --resume`` (unset, empty or ``0``: not).
- ``RLBUS_LATE_JOIN=1``: the component joins after the start of the run (a producer added by
  ``busctl scale`` or restarted), so it cannot join a weight-broadcast group formed at start.
- ``RLBUS_SPAWN_ID=<n>``: set by a launcher whose spawned process is not the component itself
  (``srun``, :mod:`busctl.launchers.slurm`): the id the supervisor knows this start by, sent in
  the ready handshake and heartbeats instead of the pid (unset: the pid).
- ``RLBUS_NODE_ADDRESS=<address>``: set by a multi-node launcher (Slurm, Ray): the address of the
  node the component runs on, where other nodes reach it. The component serves its Prometheus
  metrics there (and reports it in its ready handshake) instead of 127.0.0.1 (unset: 127.0.0.1,
  a local run).

Invariant: these names are spelled here only. The supervisor writes them with
:meth:`LaunchEnv.to_environ`, a component reads them once with :meth:`LaunchEnv.from_environ`
(done by :func:`bus.component.component_main`, kept as ``Component.launch``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

ENV_RESTARTS = "RLBUS_RESTARTS"
"""Restart count of this component (int >= 0)."""
ENV_RESUME = "RLBUS_RESUME"
"""``1`` in every component of a ``busctl up --resume`` run."""
ENV_LATE_JOIN = "RLBUS_LATE_JOIN"
"""``1`` for a component that joins a running run (scaled up or restarted producer)."""
ENV_SPAWN_ID = "RLBUS_SPAWN_ID"
"""The supervisor's id of this start when the launcher stands between them (int >= 1; set by the
launcher itself, so not among :data:`ENV_NAMES`; the local launcher removes an inherited one)."""
ENV_NODE_ADDRESS = "RLBUS_NODE_ADDRESS"
"""Address of the component's node, reachable from the other nodes (set by a multi-node launcher;
unset: a local run, metrics on 127.0.0.1). Like :data:`ENV_SPAWN_ID` set by the launcher itself, not
among :data:`ENV_NAMES`; the local launcher removes an inherited one."""
ENV_NAMES = (ENV_RESTARTS, ENV_RESUME, ENV_LATE_JOIN)
"""Every launch variable; the supervisor removes them from its own environment before adding a
component's, so a ``busctl up`` started from inside a component never leaks them."""


def _parse_int(name: str, raw: str) -> int:
    """``raw`` (the value of variable ``name``) as an int >= 0; empty means 0.

    Raises:
        ValueError: not a whole number >= 0 (the message names the variable and its value).
    """
    text = raw.strip()
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer >= 0")
    return int(text)


def _parse_flag(name: str, raw: str) -> bool:
    """``raw`` (the value of variable ``name``) as a flag: ``1`` true, empty or ``0`` false.

    Raises:
        ValueError: any other value (the message names the variable and its value).
    """
    text = raw.strip()
    if text in ("", "0"):
        return False
    if text == "1":
        return True
    raise ValueError(f"environment variable {name}={raw!r}: expected 1 (set) or 0 / empty (unset)")


@dataclass(frozen=True)
class LaunchEnv:
    """How this start of a component differs from the first start of a fresh run.

    Attributes:
        restarts: how often the supervisor restarted this component (0: first start).
        resume: the run continues a previous one (``busctl up --resume``).
        late_join: the component joins a running run (scaled up, or a restarted producer).
        spawn_id: the id the supervisor knows this start by (0: the pid; see ``RLBUS_SPAWN_ID``).
        node_address: the node's address other nodes reach (``""``: a local run; see
            ``RLBUS_NODE_ADDRESS``).
    """

    restarts: int = 0
    resume: bool = False
    late_join: bool = False
    spawn_id: int = 0
    node_address: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.restarts, bool) or not isinstance(self.restarts, int) or self.restarts < 0:
            raise ValueError(f"LaunchEnv.restarts={self.restarts!r}: expected an int >= 0")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "LaunchEnv":
        """Read the launch variables (unset ones take their defaults).

        Raises:
            ValueError: a variable is set to a value it cannot take (the message names it).
        """
        return cls(
            restarts=_parse_int(ENV_RESTARTS, environ.get(ENV_RESTARTS, "")),
            resume=_parse_flag(ENV_RESUME, environ.get(ENV_RESUME, "")),
            late_join=_parse_flag(ENV_LATE_JOIN, environ.get(ENV_LATE_JOIN, "")),
            spawn_id=_parse_int(ENV_SPAWN_ID, environ.get(ENV_SPAWN_ID, "")),
            node_address=environ.get(ENV_NODE_ADDRESS, "").strip(),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables to set for a component (only those that differ from a first start)."""
        env = {}
        if self.restarts:
            env[ENV_RESTARTS] = str(self.restarts)
        if self.resume:
            env[ENV_RESUME] = "1"
        if self.late_join:
            env[ENV_LATE_JOIN] = "1"
        if self.spawn_id:
            env[ENV_SPAWN_ID] = str(self.spawn_id)
        if self.node_address:
            env[ENV_NODE_ADDRESS] = self.node_address
        return env

    @property
    def metrics_host(self) -> str:
        """Where the component serves its metrics: the node's address on several nodes, else
        ``127.0.0.1`` (never reachable from another host)."""
        return self.node_address or "127.0.0.1"

    @property
    def continues(self) -> bool:
        """Whether the component continues earlier work (restarted or resumed), so must recover
        its state (journal, checkpoint) rather than start from scratch."""
        return self.restarts > 0 or self.resume

    @property
    def joins_late(self) -> bool:
        """Whether the component starts after the others were ready (restarted, resumed or
        scaled up): it cannot join a torch.distributed group formed at the start of the run."""
        return self.restarts > 0 or self.resume or self.late_join
