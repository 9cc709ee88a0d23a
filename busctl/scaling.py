"""``busctl scale``: how the supervisor resizes a running job.

The client writes ``RUN_DIR/scale.json`` atomically (``{"id": ..., "rewards": N, "producers": M}``); the
supervisor's watch loop reads it (no signal: a stale pid can never be hit), starts replicas with the next
indices (new producers join late and ask the trainer to re-form the weight group, :mod:`broadcaster.regroup`)
or stops the highest ones (SIGTERM: they hand back their work), and records the request's progress in
``status.json``. Never fewer than one of each role; producer ``i`` always gets the devices the device plan gives
index ``i``, and an index without devices is refused. ``servers=N`` resizes each producer's inference servers
instead (:mod:`busctl.server_scaling`). The user's view: docs/operations.md, "Scaling a running job".
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from enum import StrEnum
from pathlib import Path
from typing import Callable

from busctl.components.table import LIVE_STATES, ComponentSpec, ComponentState, describe_exit
from busctl.components.placement import Placement, apply_placement, plan_placement, visible_devices
from busctl.server_scaling import ServerRequests, check_attached_producers, check_servers_request
from configs.schema import RunConfig

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 20.0
"""Grace period between SIGTERM and SIGKILL at shutdown and scale-down, seconds."""

KILL_WAIT_S = 5.0
"""Longest wait for a SIGKILLed process to be reaped before its replacement may start, seconds."""


class ScaleState(StrEnum):
    """Where the last ``busctl scale`` request stands (``status.json``'s ``scale.state``)."""

    APPLYING = "applying"
    DONE = "done"
    """The added components are ready and the removed ones gone."""
    FAILED = "failed"
    """Refused (the reason in ``error``)."""


def kill_and_reap(spec: ComponentSpec) -> None:
    """SIGKILL the whole component and reap it (at most :data:`KILL_WAIT_S`), recording its exit code; no process:
    nothing to do."""
    if spec.proc is None:
        return
    spec.proc.signal(signal.SIGKILL)
    try:
        spec.proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) not reaped %.0f s after SIGKILL", spec.name, spec.pid, KILL_WAIT_S)
    if spec.exit_code is None:
        spec.exit_code = spec.proc.returncode


def stop_all(specs: list[ComponentSpec], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop ``specs`` (``busctl up``'s shutdown): SIGTERM to each in order, wait up to ``timeout_s`` for all together,
    then SIGKILL and reap what is left; every one ends ``exited``."""
    running = [s for s in specs if s.proc is not None]
    for spec in running:
        spec.proc.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for spec in running:
        try:
            spec.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", spec.name, timeout_s)
    for spec in running:
        spec.proc.signal(signal.SIGKILL)
        spec.proc.wait()
        if spec.state != ComponentState.EXITED:
            spec.state, spec.exit_code = ComponentState.EXITED, spec.proc.returncode
    for spec in specs:
        if spec.proc is None and spec.state != ComponentState.EXITED:
            spec.state = ComponentState.EXITED


SCALABLE = {"rewards": "rewards", "producers": "producer"}
"""``busctl scale`` keys and the role each one scales."""

SERVERS = "servers"
"""The ``busctl scale`` key of the inference servers per producer (not a role: :mod:`busctl.server_scaling`)."""

SCALE_KEYS = (*SCALABLE, SERVERS)
"""Every ``busctl scale`` key."""


def scale_targets(cfg: RunConfig, request: dict, placement: Placement | None = None) -> dict[str, int]:
    """Validate a scale request ``{"rewards": N, "producers": M, "servers": S}`` (any of them) against the run's
    config and device plan (None: planned on this host); ``{role: replicas}`` plus ``"servers"`` if asked, e.g.
    ``{"rewards": 3, "producer": 2}``.

    Raises:
        ValueError: no known key, a count that is not an int >= 1, more producers than
            ``producers.max_replicas`` (reward workers connect to that many rollouts endpoints), or
            :func:`busctl.server_scaling.check_servers_request`'s and ``check_attached_producers``' refusals.
        ConfigError (a ValueError): more producers than the GPUs have room for.
    """
    targets = {}
    for key, role in SCALABLE.items():
        if key not in request:
            continue
        n = request[key]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{key}={n!r}: need a whole number >= 1 (a run never goes below one {role})")
        targets[role] = n
    if SERVERS in request:
        targets[SERVERS] = check_servers_request(cfg, request[SERVERS])
    if not targets:
        raise ValueError(f"nothing to scale: give {' and/or '.join(k + '=N' for k in SCALE_KEYS)}")
    limit = cfg.producers.max_replicas
    if targets.get("producer", 0) > limit:
        raise ValueError(
            f"producers={targets['producer']} exceeds producers.max_replicas={limit} (reward workers connect to "
            f"that many rollouts endpoints); start the run with a larger producers.max_replicas"
        )
    if "producer" in targets:
        check_attached_producers(cfg, targets["producer"])
        (placement or plan_placement(cfg, visible_devices())).check_producers(targets["producer"])
    return targets


class Scaling:
    """Applies ``busctl scale`` requests to a running supervisor's component table (in place), from its watch loop;
    ``status_changed`` / ``targets_changed`` rewrite ``status.json`` / ``prometheus.yml``; ``placement`` None:
    :func:`busctl.components.placement.apply_placement` of ``cfg``; ``publisher`` opens a control-channel
    publisher (``servers=N`` requests; None: refused).

    Attributes:
        progress: the last request's progress, ``status.json``'s ``scale``: ``{"id", "state": ScaleState,
            "targets", "added", "removed", "error"}`` (``{}`` before any request).
    """

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: Path,
        table: list[ComponentSpec],
        *,
        spawn: Callable[[ComponentSpec], None],
        say: Callable[[str], None],
        status_changed: Callable[[], None],
        targets_changed: Callable[[], None],
        placement: Placement | None = None,
        publisher: Callable | None = None,
    ) -> None:
        self.cfg = cfg
        self.placement = placement or apply_placement(cfg)
        self.run_dir = run_dir
        self.table = table
        self.progress: dict = {}
        self._spawn, self._say = spawn, say
        self._status_changed, self._targets_changed = status_changed, targets_changed
        self._seen: tuple[int, int] | None = None
        self._next_port_offset = len(table)
        self.servers = ServerRequests(publisher) if publisher is not None else None

    def poll_request(self) -> None:
        """Apply ``RUN_DIR/scale.json`` when it holds a new request id."""
        path = self.run_dir / "scale.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        if self._seen == (st.st_mtime_ns, st.st_size):
            return
        self._seen = (st.st_mtime_ns, st.st_size)
        try:
            request = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            self.progress = {"id": None, "state": ScaleState.FAILED, "error": f"unreadable {path}: {err}"}
            return
        if not isinstance(request, dict) or request.get("id") == self.progress.get("id"):
            return
        rid = request.get("id")
        if self.progress.get("state") == ScaleState.APPLYING:
            self.progress = {
                **self.progress,
                "rejected": {"id": rid, "error": "the previous scale request is still being applied"},
            }
            return
        try:
            targets = scale_targets(self.cfg, request, self.placement)
            present = {s.role for s in self.table}
            missing = [r for r in targets if r not in present and r != SERVERS]
            if missing:
                raise ValueError(f"this run has no {missing[0]} components to scale")
            if SERVERS in targets and self.servers is None:
                raise ValueError("this supervisor cannot reach the producers' control channel")
        except ValueError as err:
            self.progress = {"id": rid, "state": ScaleState.FAILED, "error": str(err)}
            self._say(f"  [red]scale request refused[/red]: {err}")
            self._status_changed()
            return
        added, removed = [], []
        if SERVERS in targets:
            self.servers.start(rid, targets[SERVERS])
        for role, n in targets.items():
            if role == SERVERS:
                continue
            a, r = self._scale_role(role, n)
            added += a
            removed += r
        self.progress = {
            "id": rid,
            "state": ScaleState.APPLYING,
            "targets": targets,
            "added": added,
            "removed": removed,
            "error": "",
        }
        self._say(f"  [cyan]scale[/cyan] {targets}: starting {added or 'none'}, stopping {removed or 'none'}")
        self._status_changed()

    def _scale_role(self, role: str, n: int) -> tuple[list[str], list[str]]:
        """Start or stop replicas of ``role`` until ``n`` remain; returns (started, stopping) names."""
        current = sorted(
            (s for s in self.table if s.role == role and s.state != ComponentState.STOPPING), key=lambda s: s.index
        )
        added, removed = [], []
        for index in range(len(current), n):
            template = current[-1]
            base = self.cfg.metrics.base_port
            spec = ComponentSpec(
                f"{role}-{index}",
                template.module,
                index,
                late_join=(role == "producer"),
                port_request=base + self._next_port_offset if base else 0,
            )
            self._next_port_offset += 1
            last = max(k for k, s in enumerate(self.table) if s.role == role)
            self.table.insert(last + 1, spec)
            self._spawn(spec)
            added.append(spec.name)
        for spec in current[n:][::-1]:
            removed.append(spec.name)
            if spec.proc is None:  # waiting for a restart: nothing runs
                self.table.remove(spec)
                continue
            spec.proc.signal(signal.SIGTERM)
            spec.state, spec.due = ComponentState.STOPPING, time.monotonic() + STOP_TIMEOUT_S
        return added, removed

    def check_stopping(self, spec: ComponentSpec, now: float) -> None:
        """A scaled-down component: gone once its process exited; SIGKILL past its grace period."""
        if spec.proc.poll() is not None:
            spec.proc.signal(signal.SIGKILL)  # whatever of its group is left
            spec.exit_code = spec.proc.returncode
            self.table.remove(spec)
            self._say(f"  [cyan]stopped[/cyan] {spec.name} ({describe_exit(spec.exit_code)})")
            self._targets_changed()
        elif now > spec.due:
            log.warning("%s did not stop in %.0f s after SIGTERM; killing it", spec.name, STOP_TIMEOUT_S)
            spec.proc.signal(signal.SIGKILL)

    def track(self) -> None:
        """Mark the request ``done`` once the added components are ready, the removed ones gone and (``servers``)
        every producer answered; ``failed`` if a producer could not resize its servers."""
        if self.progress.get("state") != ScaleState.APPLYING:
            return
        by_name = {s.name: s for s in self.table}
        ready = all(by_name.get(n) is not None and by_name[n].state in LIVE_STATES for n in self.progress["added"])
        if SERVERS in self.progress["targets"]:
            producers = [s.name for s in self.table if s.role == "producer" and s.state != ComponentState.STOPPING]
            self.servers.poll(time.monotonic(), producers)
            answered, error = self.servers.outcome(producers)
            self.progress["servers_in_sync"] = sorted(p for p, a in self.servers.answers.items() if not a.error)
            if error:
                self.progress.update(state=ScaleState.FAILED, error=error)
                self._say(f"  [red]scale request failed[/red]: {error}")
                self._status_changed()
                return
            ready = ready and answered
        if ready and not any(n in by_name for n in self.progress["removed"]):
            self.progress["state"] = ScaleState.DONE
            self._say(f"  [cyan]scaled[/cyan] to {self.progress['targets']}")
            self._status_changed()
