"""The supervisor behind ``busctl up``: one table of components, started, watched, healed, stopped.

Lifecycle of a run:

1. ``prepare``: create the run directory (cleared of a previous run's outputs; with ``resume``
   only of what is transient: sockets, status, weight hand-over files, the final metrics
   snapshot), resolve what the config leaves open (the policy path: build or reuse the tiny
   policy; a free rendezvous port for the weight broadcast), write the resolved ``config.yaml``
   that every component reads.
2. ``start``: spawn every component of the table as its own process (own process group;
   stdout/stderr appended to ``logs/NAME.log`` after a header line) and wait for each one's
   :class:`bus.messages.ComponentReady` handshake on the ``supervisor`` socket, never a sleep.
   A component that exits, or is not ready within ``bus.ready_timeout_s``, fails the start (its
   log is named): at start-up that is a configuration or code problem, not one to retry.
3. ``watch``: print one progress line per ``trainer.step`` on the control channel; the run ends
   when the trainer announces ``run.done`` after its last step and final eval. Components stop
   working then but keep serving metrics, which are saved to ``metrics_final/`` (for
   ``bench/``). Meanwhile the supervisor heals (below) and applies ``busctl scale`` requests.
4. ``shutdown`` (always, also on SIGINT/SIGTERM): SIGTERM to every process group in reverse
   start order, SIGKILL to whatever is left after ``STOP_TIMEOUT_S``; no process is left behind.

Healing (``watch``, before ``run.done``): every component sends
:class:`bus.messages.ComponentHeartbeat` every ``bus.heartbeat_s``. A component that exits (any
exit code), is silent for ``bus.dead_after_s`` after it was ready, or (after a restart) is not
ready within ``bus.ready_timeout_s`` has crashed. With ``supervisor.restart`` and a restartable
role (:data:`RESTARTABLE_ROLES`: hub, trainer, reward workers, producers, prompt source) its
whole process group is killed (vLLM's engine processes live there), and after a backoff of
``backoff_initial_s * 2**(k-1)`` seconds (``k`` consecutive crashes, capped at
``backoff_max_s``; ``k`` restarts from 0 once the component stayed up ``backoff_reset_s``) it is
spawned again with ``RLBUS_RESTARTS=<n>``; the watch loop never blocks on it (other components
keep running, progress lines keep printing). One crash past ``supervisor.max_restarts`` fails the
run, naming the component and its log. The packer is not restartable (the groups in its buffer
would be lost): its death fails the run with a hint to ``busctl up --resume``. Restarts are
counted in ``rlbus_supervisor_restarts_total{component}``, served on the supervisor's own
metrics port (in ``status.json`` and ``prometheus.yml``).

Scaling (``busctl scale``): the client writes ``RUN_DIR/scale.json`` atomically
(``{"id": ..., "rewards": N, "producers": M}``); the watch loop reads it (no signal: a stale pid
can never be hit), starts ``rewards-i`` / ``producer-i`` with the next indices (new producers
get ``RLBUS_LATE_JOIN=1``: they cannot join a weight-broadcast group formed at start) or stops
the highest indices (SIGTERM, so they hand back their work; SIGKILL after ``STOP_TIMEOUT_S``),
and records the request's progress in ``status.json`` (``applying`` -> ``done`` once the new set
is ready and the removed ones are gone, or ``failed`` with the reason).

``status.json`` (rewritten atomically, tmp + rename, at least every second while running): the
supervisor's pid and process start time, its state and outcome, its metrics port, the last step,
the last scale request, and per component name, module, index, pid, state (``starting``,
``ready``, ``running``, ``done``, ``restarting``, ``stopping``, ``exited``), restarts,
consecutive crashes, last heartbeat (unix time), metrics port, exit code, last error.

Every component of a ``resume`` run gets ``RLBUS_RESUME=1``. Components also die with the
supervisor (``PR_SET_PDEATHSIG``, see :mod:`bus.component`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from prometheus_client import REGISTRY, Counter, generate_latest, start_http_server
from rich.console import Console

from bus import auth
from bus.messages import ComponentHeartbeat, ComponentReady, RunDone, TrainerStep
from bus.sockets import BusSocket
from bus.topics import Endpoints
from configs.schema import RunConfig, SupervisorConfig, dump_config

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 20.0
"""Grace period between SIGTERM and SIGKILL at shutdown and scale-down, seconds."""

KILL_WAIT_S = 5.0
"""Longest wait for a SIGKILLed process to be reaped before its replacement may start, seconds."""

POLL_S = 0.2
"""The watch loop wakes at least this often (messages wake it at once), seconds."""

STATUS_EVERY_S = 0.5
"""``status.json`` is rewritten at least this often while the supervisor runs, seconds."""

MAX_DRAIN = 1000
"""Most messages one socket hands over per loop turn (a flood cannot starve the checks)."""

REPO_ROOT = Path(__file__).resolve().parent.parent

RESTARTABLE_ROLES = frozenset({"hub", "trainer", "rewards", "producer", "prompt-source"})
"""Roles the supervisor restarts. Not the packer: its buffered groups would be lost."""

SCALABLE = {"rewards": "rewards", "producers": "producer"}
"""``busctl scale`` keys and the role each one scales."""

RUN_OUTPUTS = ("metrics.jsonl", "trained_samples.jsonl", "ledger.jsonl", "accounting.json", "metrics_final", "checkpoints",
               "logs", "weights", "sock", "status.json", "scale.json", "prometheus.yml")
"""Removed from the run directory by a fresh ``busctl up`` (files or directories): a fresh run
starts from an empty run directory (the prompt source's ledger, the trainer's checkpoints)."""

TRANSIENT_OUTPUTS = ("metrics_final", "weights", "sock", "status.json", "scale.json", "prometheus.yml")
"""Removed by ``busctl up --resume`` too: nothing a resumed run continues from."""

ENV_RESTARTS, ENV_RESUME, ENV_LATE_JOIN = "RLBUS_RESTARTS", "RLBUS_RESUME", "RLBUS_LATE_JOIN"
"""Environment variables the supervisor passes to components (see the module docstring)."""

RESTARTS = Counter("rlbus_supervisor_restarts_total", "Components restarted by the supervisor, per component", ["component"])

LIVE_STATES = ("ready", "running", "done")
"""States of a component that completed its ready handshake and is alive."""


@dataclass
class ComponentSpec:
    """One row of the component table, with its runtime state.

    Attributes:
        name: unique name (``"rewards-1"``); its role is the name without the ``-INDEX`` suffix.
        module: ``python -m`` entry. index: replica index.
        pid, state, metrics_port: runtime state (states: see the module docstring).
        restarts: times the supervisor restarted it. consecutive_crashes: crashes since it last
            stayed up ``backoff_reset_s``. exit_code: of its last process (negative: signal).
        last_error: why it last crashed. late_join: spawned with ``RLBUS_LATE_JOIN=1``.
        port_request: metrics port asked for at spawn (0: any free port).
        spawned_at, ready_at, last_beat: ``time.monotonic()`` of the last spawn, ready handshake
            and heartbeat (None: not yet). last_beat_wall: the heartbeat's ``time.time()``.
        due: monotonic deadline of the current state (``starting``: ready timeout;
            ``restarting``: respawn time; ``stopping``: SIGKILL time).
    """

    name: str
    module: str
    index: int = 0
    pid: int = 0
    state: str = "not started"
    metrics_port: int = 0
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
    proc: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    @property
    def role(self) -> str:
        """``"rewards"`` for ``"rewards-1"``, ``"producer"`` for ``"producer-0"``, else the name."""
        base, _, suffix = self.name.rpartition("-")
        return base if base and suffix.isdigit() else self.name

    def status_row(self) -> dict:
        """The JSON row of ``status.json``."""
        return {"name": self.name, "module": self.module, "index": self.index, "pid": self.pid, "state": self.state,
                "metrics_port": self.metrics_port, "restarts": self.restarts, "consecutive_crashes": self.consecutive_crashes,
                "last_heartbeat_at": self.last_beat_wall, "exit_code": self.exit_code, "last_error": self.last_error,
                "late_join": self.late_join}


def component_table(cfg: RunConfig) -> list[ComponentSpec]:
    """Every process of a run, in start order (the hub first, the prompt source last)."""
    table = [ComponentSpec("hub", "bus.hub"), ComponentSpec("trainer", "trainer.proc"), ComponentSpec("packer", "packer.proc")]
    table += [ComponentSpec(f"rewards-{i}", "rewards.worker", i) for i in range(cfg.rewards.replicas)]
    table += [ComponentSpec(f"producer-{i}", "producers.producer", i) for i in range(cfg.producers.replicas)]
    table.append(ComponentSpec("prompt-source", "producers.prompt_source"))
    return table


def launch_prefix(cfg: RunConfig, spec: ComponentSpec) -> list[str]:
    """The start of a component's command line: ``python -m MODULE``; for the trainer with
    ``trainer.data_parallel`` N > 1, ``python -m torch.distributed.run --standalone
    --nproc-per-node N -m MODULE`` (torchrun: every rank runs MODULE with the same arguments).

    The whole torchrun group is one component: the supervisor watches (and kills, restarts) the
    torchrun agent; its ranks run in their own sessions and die with it (``PR_SET_PDEATHSIG``),
    and rank 0 sends the ready handshake and heartbeats in the agent's name
    (:func:`trainer.distributed.launcher_pid`). ``--standalone`` picks a free local rendezvous port.
    """
    n = cfg.trainer.data_parallel
    if spec.role != "trainer" or n == 1:
        return [sys.executable, "-m", spec.module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m", spec.module]


def backoff_s(consecutive_crashes: int, sup: SupervisorConfig) -> float:
    """Delay before restarting a component after its ``consecutive_crashes``-th crash in a row
    (>= 1): ``min(backoff_max_s, backoff_initial_s * 2**(consecutive_crashes - 1))``, seconds."""
    if consecutive_crashes < 1:
        raise ValueError(f"consecutive_crashes must be >= 1, got {consecutive_crashes}")
    return min(sup.backoff_max_s, sup.backoff_initial_s * 2.0 ** min(consecutive_crashes - 1, 60))


def describe_exit(code: int) -> str:
    """``"exited with code 1"`` or ``"was killed by SIGKILL"`` (Popen's negative codes)."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def scale_targets(cfg: RunConfig, request: dict) -> dict[str, int]:
    """Validate a scale request against the run's config.

    Args:
        cfg: the run's config. request: ``{"rewards": N, "producers": M}`` (either or both;
            other keys such as ``"id"`` are ignored).

    Returns:
        ``{role: replicas}``, e.g. ``{"rewards": 3, "producer": 2}``.

    Raises:
        ValueError: no known key, a count that is not an int >= 1, or more producers than
            ``producers.max_replicas`` (reward workers connect to that many rollouts endpoints).
    """
    targets = {}
    for key, role in SCALABLE.items():
        if key not in request:
            continue
        n = request[key]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{key}={n!r}: need a whole number >= 1 (a run never goes below one {role})")
        targets[role] = n
    if not targets:
        raise ValueError(f"nothing to scale: give {' and/or '.join(k + '=N' for k in SCALABLE)}")
    limit = cfg.producers.max_replicas
    if targets.get("producer", 0) > limit:
        raise ValueError(f"producers={targets['producer']} exceeds producers.max_replicas={limit} (reward workers connect to "
                         f"that many rollouts endpoints); start the run with a larger producers.max_replicas")
    return targets


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


class RunFailed(RuntimeError):
    """A component failed to start, died when it could not be restarted, or used up its restarts."""


class Supervisor:
    """Starts, watches, heals, scales and stops the processes of one run.

    Args:
        cfg: the run config (``model.path`` and ``broadcast.port`` may be left open).
        console: where progress lines go.
        table: the components (default :func:`component_table` of ``cfg``); tests pass their own.
        resume: continue the run in its run directory (keep its outputs, ``RLBUS_RESUME=1``).

    Attributes:
        stop: set it (e.g. from a signal handler) to end ``start``/``watch`` early.
        outcome, error: set by the caller before :meth:`shutdown` (``"done"``, ``"failed"``,
            ``"interrupted"``); recorded in ``status.json``.
    """

    def __init__(self, cfg: RunConfig, console: Console | None = None, *, table: list[ComponentSpec] | None = None,
                 resume: bool = False) -> None:
        self.cfg = cfg
        self.console = console or Console(soft_wrap=True)
        self.run_dir = Path(cfg.run_dir).resolve()
        self.table = table if table is not None else component_table(cfg)
        self.resume = resume
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        auth.enable(self.ctx, auth.keys_from_config(cfg.bus))
        self.endpoints = Endpoints(cfg.bus.transport, self.run_dir, cfg.bus.host, cfg.bus.base_port)
        self.last_step: TrainerStep | None = None
        self.run_done = False
        self.state = "preparing"
        self.outcome = ""
        self.error = ""
        self.scale: dict = {}
        self.metrics_port = 0
        self._healing = False
        self._inbox: BusSocket | None = None
        self._control: BusSocket | None = None
        self._metrics_server = None
        self._next_port_offset = len(self.table)
        self._status_written = 0.0
        self._scale_seen: tuple[int, int] | None = None
        self._start_ticks = process_start_ticks(os.getpid())

    # -- prepare ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Resolve the config and write the run directory (see module docstring)."""
        for stale in TRANSIENT_OUTPUTS if self.resume else RUN_OUTPUTS:
            target = self.run_dir / stale
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.endpoints.ensure_dirs()
        if not self.cfg.model.path:
            from trainer.tiny_model import ensure_policy  # torch: imported only when needed

            self.console.print("building / loading the tiny reverse-text policy ...")
            m = self.cfg.model
            path = ensure_policy(Path(m.cache_dir), sft_steps=m.sft_steps, sft_target_loss=m.sft_target_loss, seed=self.cfg.trainer.seed)
            self.cfg.model.path = str(Path(path).resolve())
        if self.cfg.broadcast.method == "broadcast" and self.cfg.broadcast.port == 0:
            self.cfg.broadcast.port = free_port(self.cfg.broadcast.host)
        self.cfg.run_dir = str(self.run_dir)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))

    # -- start -----------------------------------------------------------------------------------

    def log_path(self, spec: ComponentSpec) -> Path:
        """``RUN_DIR/logs/NAME.log``: the component's stdout and stderr, appended per start."""
        return self.run_dir / "logs" / f"{spec.name}.log"

    def _spawn(self, spec: ComponentSpec) -> None:
        env = {k: v for k, v in os.environ.items() if k not in (ENV_RESTARTS, ENV_RESUME, ENV_LATE_JOIN)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        if self.resume:
            env[ENV_RESUME] = "1"
        if spec.restarts:
            env[ENV_RESTARTS] = str(spec.restarts)
        if spec.late_join:
            env[ENV_LATE_JOIN] = "1"
        cmd = [*launch_prefix(self.cfg, spec), "--run-dir", str(self.run_dir), "--name", spec.name,
               "--index", str(spec.index), "--metrics-port", str(spec.port_request)]
        notes = [f"restart {spec.restarts}"] if spec.restarts else []
        notes += ["resume"] * self.resume + ["late join"] * spec.late_join
        with open(self.log_path(spec), "ab") as logfile:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            logfile.write(f"===== rlbus {stamp}: starting {spec.name} {'(' + ', '.join(notes) + ')' if notes else ''} =====\n".encode())
            logfile.flush()
            spec.proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, cwd=os.getcwd(), start_new_session=True)
        now = time.monotonic()
        spec.pid, spec.state, spec.exit_code = spec.proc.pid, "starting", None
        spec.spawned_at, spec.ready_at, spec.last_beat, spec.last_beat_wall = now, None, None, None
        spec.due = now + self.cfg.bus.ready_timeout_s

    def start(self) -> None:
        """Spawn every component and wait for all ready handshakes.

        Raises:
            RunFailed: a component exited, or was not ready within ``bus.ready_timeout_s``, or
                ``stop`` was set.
        """
        self.state = "starting"
        self._inbox = BusSocket(self.ctx, "supervisor", "recv", self.endpoints.address("supervisor"), bind=True, stop=self.stop,
                                accept=(ComponentReady, ComponentHeartbeat))
        self._metrics_server, _thread = start_http_server(0, addr="127.0.0.1")
        self.metrics_port = int(self._metrics_server.server_address[1])
        base = self.cfg.metrics.base_port
        for k, spec in enumerate(self.table):
            spec.port_request = base + k if base else 0
            self._spawn(spec)
        self.write_status()
        while any(s.state not in LIVE_STATES for s in self.table):
            if self.stop.is_set():
                raise RunFailed("interrupted during start-up")
            self._turn()
        self.write_scrape_config()

    # -- watch -----------------------------------------------------------------------------------

    def watch(self) -> None:
        """Print progress, heal and scale until the trainer announces ``run.done``, then save
        every component's metrics (they keep serving them until shutdown).

        Raises:
            RunFailed: a component died and cannot be restarted (see the module docstring).
        """
        self.state, self._healing = "running", True
        self._control = BusSocket(self.ctx, "control_sub", "recv", self.endpoints.address("control_sub"), bind=False, stop=self.stop)
        while not self.stop.is_set() and not self.run_done:
            self._turn()
        self._healing = False
        if self.run_done:
            self.snapshot_metrics()

    def _turn(self) -> None:
        """One turn of the loop: wait up to :data:`POLL_S` for messages, handle every pending
        one, then check the components (crashes, deadlines, restarts, scaling) and the status file."""
        socks = [s for s in (self._inbox, self._control) if s is not None]
        poller = zmq.Poller()
        for s in socks:
            poller.register(s.sock, zmq.POLLIN)
        poller.poll(int(POLL_S * 1000))
        for s in socks:
            for _ in range(MAX_DRAIN):
                msg = s.recv(timeout_s=0)
                if msg is None:
                    break
                self._handle(msg)
        if not self.run_done:
            self._check(time.monotonic())
        if time.monotonic() - self._status_written >= STATUS_EVERY_S:
            self.write_status()

    def _handle(self, msg: object) -> None:
        by_name = {s.name: s for s in self.table}
        if isinstance(msg, ComponentReady):
            spec = by_name.get(msg.name)
            if spec is None or spec.pid != msg.pid or spec.state != "starting":
                return  # a predecessor's late handshake, or a stranger
            spec.state, spec.metrics_port, spec.ready_at = "ready", msg.metrics_port, time.monotonic()
            again = f", restart {spec.restarts}" if spec.restarts else ""
            self.console.print(f"  [green]ready[/green] {msg.name} (pid {msg.pid}, metrics :{msg.metrics_port}{again})")
            if self._healing:
                self.write_scrape_config()
            self.write_status()
        elif isinstance(msg, ComponentHeartbeat):
            spec = by_name.get(msg.name)
            if spec is None or spec.pid != msg.pid:
                return
            spec.last_beat, spec.last_beat_wall = time.monotonic(), time.time()
            if spec.state in LIVE_STATES:
                spec.state = "done" if msg.state == "done" else "running"
        elif isinstance(msg, TrainerStep) and (self.last_step is None or msg.step > self.last_step.step):
            self.last_step = msg
            self.console.print(self.progress_line(msg))
        elif isinstance(msg, RunDone):
            self.run_done = True

    def progress_line(self, msg: TrainerStep) -> str:
        """``step 12/60 | reward 0.512 | loss ... | tokens/s ... | lag mean/max``."""
        m = msg.metrics
        return (
            f"step {msg.step:>4}/{self.cfg.trainer.max_steps} | reward {m.get('reward_mean', 0):.3f}"
            f" | loss {m.get('loss', 0):+.4f} | kl {m.get('kl', 0):.4f} | {m.get('tokens_per_s', 0):,.0f} tok/s"
            f" | lag {m.get('policy_lag_mean', 0):.2f}/{m.get('policy_lag_max', 0):.0f} | {m.get('step_time_s', 0):.2f} s"
        )

    # -- healing ---------------------------------------------------------------------------------

    def _check(self, now: float) -> None:
        """Judge every component; restart what is due; apply and track scale requests."""
        if self._healing:
            self._poll_scale_request()
        for spec in list(self.table):
            if spec.state == "restarting":
                if now >= spec.due:
                    self._restart(spec)
            elif spec.state == "stopping":
                self._check_stopping(spec, now)
            elif spec.proc is not None and spec.state in ("starting", *LIVE_STATES):
                code = spec.proc.poll()
                if code is not None:
                    spec.exit_code = code
                    self._crashed(spec, describe_exit(code))
                elif spec.state == "starting" and now > spec.due:
                    self._crashed(spec, f"was not ready within {self.cfg.bus.ready_timeout_s:g} s")
                elif spec.state in LIVE_STATES and now - max(spec.ready_at or 0.0, spec.last_beat or 0.0) > self.cfg.bus.dead_after_s:
                    silent = now - max(spec.ready_at or 0.0, spec.last_beat or 0.0)
                    self._crashed(spec, f"was silent for {silent:.1f} s (no heartbeat; bus.dead_after_s={self.cfg.bus.dead_after_s:g})")
        if self._healing:
            self._track_scale()

    def _kill_group(self, spec: ComponentSpec) -> None:
        """SIGKILL the component's whole process group and reap its leader (bounded wait)."""
        if spec.proc is None:
            return
        _signal_group(spec.pid, signal.SIGKILL)
        try:
            spec.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) not reaped %.0f s after SIGKILL", spec.name, spec.pid, KILL_WAIT_S)
        if spec.exit_code is None:
            spec.exit_code = spec.proc.returncode

    def _crashed(self, spec: ComponentSpec, reason: str) -> None:
        """A component died (``reason``): schedule its restart, or fail the run.

        Raises:
            RunFailed: not healing (start-up), restarts disabled, a role that cannot be
                restarted (the packer), or the restart budget is spent.
        """
        now = time.monotonic()
        self._kill_group(spec)
        spec.last_error = reason
        where = f"see {self.log_path(spec)}"
        log.info("%s (pid %d) %s", spec.name, spec.pid, reason)  # the console line follows
        if not self._healing or not self.cfg.supervisor.restart:
            spec.state = "exited"
            self.write_status()
            raise RunFailed(f"{spec.name} {reason}; {where}")
        if spec.role not in RESTARTABLE_ROLES:
            spec.state = "exited"
            self.write_status()
            if spec.role == "packer":
                raise RunFailed(f"packer {reason}: its buffered groups are lost, so it is not restarted; continue the run "
                                f"from its last checkpoint with `busctl up --resume {self.run_dir}`; {where}")
            raise RunFailed(f"{spec.name} {reason} and cannot be restarted; {where}")
        budget = self.cfg.supervisor.max_restarts
        if spec.restarts >= budget:
            spec.state = "exited"
            self.write_status()
            raise RunFailed(f"{spec.name} {reason} after {spec.restarts} restarts: its restart budget "
                            f"(supervisor.max_restarts={budget}) is spent; {where}")
        if spec.ready_at is not None and now - spec.ready_at >= self.cfg.supervisor.backoff_reset_s:
            spec.consecutive_crashes = 0
        spec.consecutive_crashes += 1
        delay = backoff_s(spec.consecutive_crashes, self.cfg.supervisor)
        spec.state, spec.due, spec.proc = "restarting", now + delay, None
        self.console.print(f"  [yellow]crashed[/yellow] {spec.name} (pid {spec.pid}) {reason}; restart "
                           f"{spec.restarts + 1}/{budget} in {delay:g} s")
        self.write_status()

    def _restart(self, spec: ComponentSpec) -> None:
        spec.restarts += 1
        RESTARTS.labels(spec.name).inc()
        if spec.role == "producer":
            spec.late_join = True  # the weight-broadcast group was formed at start without it
        self._spawn(spec)
        log.info("restarted %s as pid %d (restart %d, after: %s)", spec.name, spec.pid, spec.restarts, spec.last_error)
        self.write_status()

    # -- scaling ---------------------------------------------------------------------------------

    def _poll_scale_request(self) -> None:
        """Apply ``RUN_DIR/scale.json`` when it holds a new request id."""
        path = self.run_dir / "scale.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        if self._scale_seen == (st.st_mtime_ns, st.st_size):
            return
        self._scale_seen = (st.st_mtime_ns, st.st_size)
        try:
            request = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            self.scale = {"id": None, "state": "failed", "error": f"unreadable {path}: {err}"}
            return
        if not isinstance(request, dict) or request.get("id") == self.scale.get("id"):
            return
        rid = request.get("id")
        if self.scale.get("state") == "applying":
            self.scale = {**self.scale, "rejected": {"id": rid, "error": "the previous scale request is still being applied"}}
            return
        try:
            targets = scale_targets(self.cfg, request)
            present = {s.role for s in self.table}
            missing = [r for r in targets if r not in present]
            if missing:
                raise ValueError(f"this run has no {missing[0]} components to scale")
        except ValueError as err:
            self.scale = {"id": rid, "state": "failed", "error": str(err)}
            self.console.print(f"  [red]scale request refused[/red]: {err}")
            self.write_status()
            return
        added, removed = [], []
        for role, n in targets.items():
            a, r = self._scale_role(role, n)
            added += a
            removed += r
        self.scale = {"id": rid, "state": "applying", "targets": targets, "added": added, "removed": removed, "error": ""}
        self.console.print(f"  [cyan]scale[/cyan] {targets}: starting {added or 'none'}, stopping {removed or 'none'}")
        self.write_status()

    def _scale_role(self, role: str, n: int) -> tuple[list[str], list[str]]:
        """Start or stop replicas of ``role`` until ``n`` remain; returns (started, stopping) names."""
        current = sorted((s for s in self.table if s.role == role and s.state != "stopping"), key=lambda s: s.index)
        added, removed = [], []
        for index in range(len(current), n):
            template = current[-1]
            base = self.cfg.metrics.base_port
            spec = ComponentSpec(f"{role}-{index}", template.module, index, late_join=(role == "producer"),
                                 port_request=base + self._next_port_offset if base else 0)
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
            _signal_group(spec.pid, signal.SIGTERM)
            spec.state, spec.due = "stopping", time.monotonic() + STOP_TIMEOUT_S
        return added, removed

    def _check_stopping(self, spec: ComponentSpec, now: float) -> None:
        """A scaled-down component: gone once its process exited; SIGKILL past its grace period."""
        if spec.proc.poll() is not None:
            _signal_group(spec.pid, signal.SIGKILL)  # whatever of its group is left
            spec.exit_code = spec.proc.returncode
            self.table.remove(spec)
            self.console.print(f"  [cyan]stopped[/cyan] {spec.name} ({describe_exit(spec.exit_code)})")
            self.write_scrape_config()
        elif now > spec.due:
            log.warning("%s did not stop in %.0f s after SIGTERM; killing it", spec.name, STOP_TIMEOUT_S)
            _signal_group(spec.pid, signal.SIGKILL)

    def _track_scale(self) -> None:
        if self.scale.get("state") != "applying":
            return
        by_name = {s.name: s for s in self.table}
        ready = all(by_name.get(n) is not None and by_name[n].state in LIVE_STATES for n in self.scale["added"])
        if ready and not any(n in by_name for n in self.scale["removed"]):
            self.scale["state"] = "done"
            self.console.print(f"  [cyan]scaled[/cyan] to {self.scale['targets']}")
            self.write_status()

    # -- status files ----------------------------------------------------------------------------

    def write_status(self) -> None:
        """Write ``status.json`` atomically (tmp + rename; fields: see the module docstring)."""
        status = {
            "supervisor_pid": os.getpid(), "supervisor_start_ticks": self._start_ticks, "run_dir": str(self.run_dir),
            "state": self.state, "outcome": self.outcome, "error": self.error, "resume": self.resume,
            "updated_at": time.time(), "metrics_port": self.metrics_port,
            "step": self.last_step.step if self.last_step else None, "scale": self.scale,
            "components": [s.status_row() for s in self.table],
        }
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(self.run_dir / "status.json")
        self._status_written = time.monotonic()

    def snapshot_metrics(self) -> None:
        """Save every component's ``/metrics`` text to ``metrics_final/NAME.prom`` (end of run),
        and the supervisor's own to ``metrics_final/supervisor.prom``."""
        out = self.run_dir / "metrics_final"
        out.mkdir(exist_ok=True)
        (out / "supervisor.prom").write_bytes(generate_latest(REGISTRY))
        for spec in self.table:
            if not spec.metrics_port:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{spec.metrics_port}/metrics", timeout=2) as resp:
                    (out / f"{spec.name}.prom").write_bytes(resp.read())
            except OSError as exc:
                log.warning("could not scrape %s: %s", spec.name, exc)

    def write_scrape_config(self) -> None:
        """Write ``prometheus.yml``: one scrape target per component's metrics port, plus the supervisor's."""
        ports = [s.metrics_port for s in self.table if s.metrics_port] + [self.metrics_port] * bool(self.metrics_port)
        targets = [f"127.0.0.1:{p}" for p in ports]
        text = (
            "scrape_configs:\n  - job_name: rlbus\n    scrape_interval: 5s\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n        labels: {{run: {json.dumps(self.cfg.name)}}}\n"
        )
        tmp = self.run_dir / "prometheus.yml.tmp"
        tmp.write_text(text)
        tmp.replace(self.run_dir / "prometheus.yml")

    # -- shutdown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every component (SIGTERM, then SIGKILL after the grace period); idempotent."""
        if self.ctx.closed:
            return
        self.state = "stopping"
        running = [s for s in reversed(self.table) if s.proc is not None]
        for spec in running:
            _signal_group(spec.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for spec in running:
            try:
                spec.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", spec.name, STOP_TIMEOUT_S)
        for spec in running:
            _signal_group(spec.pid, signal.SIGKILL)  # also reaps children (vLLM engine processes)
            spec.proc.wait()
            if spec.state != "exited":
                spec.state, spec.exit_code = "exited", spec.proc.returncode
        for spec in self.table:
            if spec.proc is None and spec.state != "exited":
                spec.state = "exited"  # was waiting for a restart
        for sock in (self._inbox, self._control):
            if sock is not None:
                sock.close()
        self._inbox = self._control = None
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        self.state = "stopped"
        if self.run_dir.is_dir():
            self.write_status()
        auth.disable(self.ctx)
        self.ctx.term()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
