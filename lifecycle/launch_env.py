"""The launch environment: what the supervisor tells a component about this start of it, in ``RLBUS_*``
variables spelled only here (:meth:`LaunchEnv.to_environ`, read once by :meth:`LaunchEnv.from_environ`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

ENV_RESTARTS = "RLBUS_RESTARTS"  # restarts of this component (int >= 0)
ENV_RESUME = "RLBUS_RESUME"  # 1 in every component of a busctl up --resume run
ENV_LATE_JOIN = "RLBUS_LATE_JOIN"  # 1 for a component joining a running run (scaled up, restarted producer)
# Set by a launcher itself, not among ENV_NAMES (the local launcher removes inherited ones): the supervisor's
# id of this start when srun stands between them (int >= 1); the node's address other nodes reach.
ENV_SPAWN_ID = "RLBUS_SPAWN_ID"
ENV_NODE_ADDRESS = "RLBUS_NODE_ADDRESS"
ENV_NAMES = (ENV_RESTARTS, ENV_RESUME, ENV_LATE_JOIN)  # removed from busctl's own environment: never leaked


def _parse_int(name: str, raw: str) -> int:
    """``raw`` (variable ``name``) as an int >= 0, empty 0; else ValueError naming the variable."""
    text = raw.strip()
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"environment variable {name}={raw!r}: expected an integer >= 0")
    return int(text)


def _parse_flag(name: str, raw: str) -> bool:
    """``raw`` (variable ``name``) as a flag, ``1`` or empty/``0``; else ValueError naming the variable."""
    text = raw.strip()
    if text in ("", "0"):
        return False
    if text == "1":
        return True
    raise ValueError(f"environment variable {name}={raw!r}: expected 1 (set) or 0 / empty (unset)")


@dataclass(frozen=True)
class LaunchEnv:
    """How this start differs from a fresh run's first (``spawn_id`` 0: the pid; ``node_address`` ``""``: local)."""

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
        """Read the launch variables (unset: defaults); ValueError names a variable set to a bad value."""
        return cls(
            restarts=_parse_int(ENV_RESTARTS, environ.get(ENV_RESTARTS, "")),
            resume=_parse_flag(ENV_RESUME, environ.get(ENV_RESUME, "")),
            late_join=_parse_flag(ENV_LATE_JOIN, environ.get(ENV_LATE_JOIN, "")),
            spawn_id=_parse_int(ENV_SPAWN_ID, environ.get(ENV_SPAWN_ID, "")),
            node_address=environ.get(ENV_NODE_ADDRESS, "").strip(),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables to set (those that differ from a first start)."""
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
        """Where the component serves metrics: the node's address, else ``127.0.0.1``."""
        return self.node_address or "127.0.0.1"

    @property
    def continues(self) -> bool:
        """Restarted or resumed: recover state (journal, checkpoint) instead of starting afresh."""
        return self.restarts > 0 or self.resume

    @property
    def joins_late(self) -> bool:
        """Started after the others were ready: it cannot join a torch.distributed group formed at start."""
        return self.restarts > 0 or self.resume or self.late_join
