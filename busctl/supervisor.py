"""The supervisor behind ``busctl up``: one table of components, started, watched, healed, stopped.

A run goes ``prepare`` (run directory, resolved ``config.yaml``), ``start`` (spawn every component of
:mod:`busctl.components.table` through the launcher, producers first, and wait for each ready handshake, never a
sleep), ``watch`` (a progress line per ``trainer.step``, healing, ``busctl scale`` requests, until the trainer's
``run.done``; then ``metrics_final/``) and ``shutdown`` (always: SIGTERM in reverse start order, SIGKILL after
``STOP_TIMEOUT_S``). Healing is the pure :func:`busctl.components.healing.decide`; this class gathers its facts by
polling the processes and carries out its decisions without blocking the loop. A binding component placed at another
address has its endpoints moved first (:mod:`busctl.rebinding`). The story (heartbeats, backoff, what a restart
of each role resumes from) is in docs/ARCHITECTURE.md, "Lifecycle and healing".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

import zmq
from prometheus_client import REGISTRY, Counter, generate_latest
from rich.console import Console
from rich.markup import escape

from bus import auth
from lifecycle.launch_env import ENV_NAMES, LaunchEnv
from bus.control import ControlPublisher
from bus.messages import (
    ComponentHeartbeat,
    ComponentPhase,
    ComponentReady,
    RunDone,
    RunFinalStep,
    ServersScaled,
    TrainerStep,
)
from telemetry.metrics import start_metrics_server
from telemetry.tls import tls_from_config
from bus.sockets import BusSocket
from bus.topics import Endpoints
from busctl.components.table import (
    LIVE_STATES,
    ComponentSpec,
    ComponentState,
    claim_broadcast_port,
    component_table,
    launch_prefix,
    process_start_ticks,
)
from busctl.components.healing import (
    ComponentFacts,
    Decision,
    FailRun,
    HealingRules,
    RestartNow,
    ScheduleRestart,
    decide,
)
from busctl.failures import FailureBoard, last_exception
from busctl.finish import FinishRequests
from busctl.launchers import Launcher, check_crash
from busctl.launchers.local import LocalLauncher
from busctl.live import progress_line
from busctl.metrics_targets import live_targets, prometheus_targets, served_targets, supervisor_metrics_host
from busctl.rebinding import rebind
from busctl.run_status import (
    EventLog,
    RunOutcome,
    RunState,
    StepClock,
    append_stage_record,
    clear_run_dir,
    snapshot_metrics,
    write_json_atomic,
    write_scrape_config,
)
from busctl.scaling import Placement, Scaling, kill_and_reap, stop_all
from busctl.scrape import MetricsPoller
from busctl.startup import StartupClock
from configs.schema import RunConfig, dump_config

log = logging.getLogger(__name__)

POLL_S = 0.2
"""The watch loop wakes at least this often (messages wake it at once), seconds."""

STATUS_EVERY_S = 0.5
"""``status.json`` is rewritten at least this often while the supervisor runs, seconds."""

MAX_DRAIN = 1000
"""Most messages one socket hands over per loop turn (a flood cannot starve the checks)."""

REPO_ROOT = Path(__file__).resolve().parent.parent

RESTARTS = Counter(
    "rlbus_supervisor_restarts_total", "Components restarted by the supervisor, per component", ["component"]
)


class RunFailed(RuntimeError):
    """A component failed to start, died when it could not be restarted, or used up its restarts."""


class Supervisor:
    """Starts, watches, heals, scales and stops the processes of one run.

    Args:
        cfg: the run config (``model.path`` and ``broadcast.port`` may be left open).
        table: the components (default :func:`component_table` of ``cfg``); tests pass their own.
        resume: continue the run in its run directory (keep its outputs, ``RLBUS_RESUME=1``).
        launcher: starts the processes (default: local; its ``configure`` already ran on ``cfg``).

    Attributes:
        stop: set it (e.g. from a signal handler) to end ``start``/``watch`` early.
        outcome, error: set by the caller before :meth:`shutdown`; recorded in ``status.json``.
        snapshot: the last ``status.json`` content (a new dict each time: safe to read from another thread).
    """

    def __init__(
        self,
        cfg: RunConfig,
        console: Console | None = None,
        *,
        table: list[ComponentSpec] | None = None,
        resume: bool = False,
        launched_at: float | None = None,
        placement: Placement | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        self.cfg = cfg
        self.console = console or Console(soft_wrap=True)
        self.run_dir = Path(cfg.run_dir).resolve()
        self.table = table if table is not None else component_table(cfg)
        self.resume = resume
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        auth.enable(self.ctx, auth.keys_from_config(cfg.bus))
        self.metrics_tls = tls_from_config(cfg.bus)  # HTTPS + client certificates with tcp + CurveZMQ
        self._scrape_tls = self.metrics_tls and self.metrics_tls.client_context()
        self.launcher = launcher or LocalLauncher()
        self.endpoints = Endpoints(
            cfg.bus.transport, self.run_dir, cfg.bus.host, cfg.bus.base_port, dict(cfg.bus.hosts)
        )
        self.last_step: TrainerStep | None = None
        self.run_done = False
        self.state = RunState.PREPARING
        self.outcome: RunOutcome | str = ""
        self.error = ""
        self.metrics_port = 0
        self._healing = False
        self._inbox: BusSocket | None = None
        self._control: BusSocket | None = None
        self._metrics_server = None
        self._status_written = 0.0
        self._start_ticks = process_start_ticks(os.getpid())
        self.snapshot: dict = {}
        self.events = EventLog()
        self.steps = StepClock()
        self.startup = StartupClock(self.run_dir, launched_at)
        self.failures = FailureBoard(cfg.rewards.max_error_fraction)  # user functions' failure shares
        self.poller = MetricsPoller(
            lambda: live_targets(self.table), tls=self._scrape_tls
        )  # read on the poller's thread
        self.scaling = Scaling(
            cfg,
            self.run_dir,
            self.table,
            spawn=self._spawn,
            say=self.say,
            status_changed=self.write_status,
            targets_changed=self.write_scrape_config,
            placement=placement,
            publisher=self._publish_control,  # busctl scale servers=N
        )
        self.finish = FinishRequests(self.run_dir, self._publish_control)  # busctl down --finish

    def _publish_control(self) -> ControlPublisher:
        """A publisher on the control channel at the hub (``bus.hosts`` now)."""
        return ControlPublisher(self.ctx, self.endpoints.address("control_pub"), stop=self.stop)

    @property
    def final_step(self) -> int:
        """The step the run ends after: ``trainer.max_steps``, or lower after ``busctl down --finish``."""
        return self.cfg.trainer.max_steps if self.finish.final_step is None else self.finish.final_step

    def say(self, markup: str) -> None:
        """Print an event line (rich markup) and keep it among the recent events."""
        self.console.print(markup)
        self.events.add(markup)

    # -- prepare ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Resolve the config (tiny policy path, broadcast port) and write the run directory."""
        clear_run_dir(self.run_dir, self.resume)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.endpoints.ensure_dirs()
        if not self.cfg.model.path:
            from policies.tiny_model import ensure_policy  # torch: imported only when needed

            self.say("building / loading the tiny reverse-text policy ...")
            m = self.cfg.model
            path = ensure_policy(
                Path(m.cache_dir), sft_steps=m.sft_steps, sft_target_loss=m.sft_target_loss, seed=self.cfg.trainer.seed
            )
            self.cfg.model.path = str(Path(path).resolve())
        claim_broadcast_port(self.cfg)
        self.cfg.run_dir = str(self.run_dir)
        (self.run_dir / "config.yaml").write_text(dump_config(self.cfg))

    # -- start -----------------------------------------------------------------------------------

    def log_path(self, spec: ComponentSpec) -> Path:
        """``RUN_DIR/logs/NAME.log``: the component's stdout and stderr, appended per start."""
        return self.run_dir / "logs" / f"{spec.name}.log"

    def _spawn(self, spec: ComponentSpec) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
        paths = [str(REPO_ROOT), *self.cfg.task.code_paths, env.get("PYTHONPATH")]  # every launcher passes env on
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(
            LaunchEnv(restarts=spec.restarts, resume=self.resume, late_join=spec.late_join).to_environ(),
            **self.scaling.placement.environ(spec.role, spec.index),
        )
        cmd = [
            *launch_prefix(self.cfg, spec),
            "--run-dir",
            str(self.run_dir),
            "--name",
            spec.name,
            "--index",
            str(spec.index),
            "--metrics-port",
            str(spec.port_request),
        ]
        peers = self._rebind(spec)
        notes = [f"restart {spec.restarts}"] if spec.restarts else []
        notes += ["resume"] * self.resume + ["late join"] * spec.late_join
        note = "(" + ", ".join(notes) + ")" if notes else ""
        with open(self.log_path(spec), "ab", buffering=0) as logfile:  # unbuffered: the header precedes the output
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            logfile.write(f"===== rlbus {stamp}: starting {spec.name} {note} =====\n".encode())
            spec.proc = self.launcher.spawn(spec, cmd, env, logfile)
        RESTARTS.labels(spec.name)  # the series exists (0) from the first spawn
        now = spec.spawned_at = time.monotonic()
        spec.pid, spec.state, spec.exit_code, spec.ready_at, spec.last_beat, spec.last_beat_wall = (
            spec.proc.pid,
            ComponentState.STARTING,
            None,
            None,
            None,
            None,
        )
        spec.due = now + self.cfg.bus.ready_timeout_s
        for peer in peers:  # they hold the moved endpoints' old address
            kill_and_reap(peer)
            self._restart(peer)

    def _rebind(self, spec: ComponentSpec) -> list[ComponentSpec]:
        """Move the endpoints ``spec`` binds to where its launcher places it; the peers to restart after."""
        move = rebind(self.cfg, self.run_dir, spec, getattr(self.launcher, "place", lambda _: "")(spec), self.table)
        if move is None:
            return []
        self.endpoints = replace(self.endpoints, hosts=dict(move.hosts))
        if move.control_moved and self._control is not None:
            self._control.close()
            self._control = self._subscribe_control()
            self.finish.close()  # reopened at the hub's new address when needed
            self.scaling.servers.close()
        self.say(
            f"  [yellow]moved[/yellow] {spec.name} to {move.address} ({', '.join(move.keys)}); "
            f"restarting {', '.join(move.restart)}"
        )
        return [
            s
            for s in self.table
            if s.name in move.restart and s.proc is not None and s.state != ComponentState.STOPPING
        ]

    def _subscribe_control(self) -> BusSocket:
        """busctl's subscription to the control channel at the hub (``bus.hosts`` now)."""
        return BusSocket(
            self.ctx, "control_sub", "recv", self.endpoints.address("control_sub"), bind=False, stop=self.stop
        )

    def start(self) -> None:
        """Spawn every component and wait for all ready handshakes.

        Raises:
            RunFailed: a component exited, or was not ready within ``bus.ready_timeout_s``, or
                ``stop`` was set.
        """
        self.state = RunState.STARTING
        self._inbox = BusSocket(
            self.ctx,
            "supervisor",
            "recv",
            self.endpoints.address("supervisor"),
            bind=True,
            stop=self.stop,
            accept=(ComponentReady, ComponentHeartbeat),
        )
        self._metrics_server = start_metrics_server(
            0,
            host := supervisor_metrics_host(self.cfg),
            health=self.health,
            tls=self.metrics_tls and self.metrics_tls.server_context(host),
        )
        self.metrics_port = int(self._metrics_server.server_address[1])
        self._control = self._subscribe_control()
        base = self.cfg.metrics.base_port
        for k, spec in enumerate(self.table):
            spec.port_request = base + k if base else 0
        for spec in sorted(self.table, key=lambda s: s.role != "producer"):  # stable: else table order
            self._spawn(spec)
        self.write_status()
        while any(s.state not in LIVE_STATES for s in self.table):
            if self.stop.is_set():
                raise RunFailed("interrupted during start-up")
            self._turn()
        self.write_scrape_config()
        self.poller.start()

    # -- watch -----------------------------------------------------------------------------------

    def watch(self) -> None:
        """Print progress, heal and scale until the trainer announces ``run.done``, then save the metrics.

        Raises:
            RunFailed: a component died and cannot be restarted.
        """
        self.state, self._healing = RunState.RUNNING, True
        while not self.stop.is_set() and not self.run_done:
            self._turn()
        self._healing = False
        if self.run_done:
            self.snapshot_metrics()

    def _turn(self) -> None:
        """Wait up to :data:`POLL_S` for messages, handle them, then check the components and the status file."""
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
            if spec is None or spec.pid != msg.pid or spec.state != ComponentState.STARTING:
                return  # a predecessor's late handshake, or a stranger
            spec.state, spec.metrics_port, spec.ready_at = ComponentState.READY, msg.metrics_port, time.monotonic()
            spec.metrics_host = msg.metrics_host or "127.0.0.1"
            again = f", restart {spec.restarts}" if spec.restarts else ""
            host = "" if spec.metrics_host == "127.0.0.1" else spec.metrics_host  # another node's: named
            self.say(f"  [green]ready[/green] {msg.name} (pid {msg.pid}, metrics {host}:{msg.metrics_port}{again})")
            if self._healing:
                self.write_scrape_config()
            self.write_status()
        elif isinstance(msg, ComponentHeartbeat):
            spec = by_name.get(msg.name)
            if spec is None or spec.pid != msg.pid:
                return
            spec.last_beat, spec.last_beat_wall = time.monotonic(), time.time()
            if spec.state in LIVE_STATES:
                spec.state = ComponentState.DONE if msg.state == ComponentPhase.DONE else ComponentState.RUNNING
            lines, stop = self.failures.update(msg.name, msg.pid, msg.failures)
            for line in lines:
                self.say(line)
            if stop is not None:
                self.write_status()
                raise RunFailed(f"{stop}; see {self.log_path(spec)}")
        elif isinstance(msg, TrainerStep) and (self.last_step is None or msg.step > self.last_step.step):
            if self.last_step is None:
                self.say(self.startup.record(msg.step, self.table))
            self.last_step = msg
            self.steps.step(msg.step)
            append_stage_record(
                self.run_dir / "stages.jsonl", msg.step, self.poller.stats, {s.name: s.role for s in self.table}
            )
            self.console.print(progress_line(msg.step, self.final_step, msg.metrics))
            self.write_status()  # the live display and `busctl status` show the step at once
        elif isinstance(msg, RunDone):
            self.run_done = True
        elif isinstance(msg, RunFinalStep) and msg.step != self.finish.final_step:
            self.finish.final_step = msg.step
            self.say(f"finishing early: the run ends after step {msg.step} (busctl down --finish)")
            self.write_status()
        elif isinstance(msg, ServersScaled):
            self.scaling.servers.on_answer(msg)

    # -- healing ---------------------------------------------------------------------------------

    def _check(self, now: float) -> None:
        """Carry out :func:`busctl.components.healing.decide` on every component and track scale requests.

        Raises:
            RunFailed: a :class:`busctl.components.healing.FailRun` decision.
        """
        if self._healing:
            self.scaling.poll_request()
            self.finish.poll(now)
        for spec in [s for s in self.table if s.state == ComponentState.STOPPING]:
            self.scaling.check_stopping(spec, now)
        rules = HealingRules.from_config(self.cfg, healing=self._healing, run_dir=str(self.run_dir))
        by_name = {s.name: s for s in self.table}
        for decision in decide([self._facts(s) for s in self.table if s.state != ComponentState.STOPPING], now, rules):
            self._carry_out(decision, by_name[decision.name])
        if self._healing:
            self.scaling.track()

    @staticmethod
    def _facts(spec: ComponentSpec) -> ComponentFacts:
        """What the healing policy needs of ``spec``; polls its process (an exit is recorded)."""
        if spec.proc is not None and spec.exit_code is None and spec.state in (ComponentState.STARTING, *LIVE_STATES):
            spec.exit_code = spec.proc.poll()
        return ComponentFacts(
            name=spec.name,
            role=spec.role,
            state=spec.state,
            pid=spec.pid,
            exit_code=spec.exit_code,
            restarts=spec.restarts,
            consecutive_crashes=spec.consecutive_crashes,
            ready_at=spec.ready_at,
            last_beat=spec.last_beat,
            due=spec.due,
        )

    def _carry_out(self, decision: Decision, spec: ComponentSpec) -> None:
        """Do what the healing policy decided for ``spec``; RunFailed on a FailRun."""
        if isinstance(decision, RestartNow):
            self._restart(spec)
            return
        kill_and_reap(spec)
        spec.last_error = decision.reason
        log.info("%s (pid %d) %s", spec.name, spec.pid, decision.reason)  # the console line follows
        decision, moved = check_crash(self.launcher, spec, decision)  # slurm: a dead node fails the run, or moves it
        if moved:
            self.say(f"  [yellow]node down[/yellow] {escape(moved)}")
        cause = last_exception(self.log_path(spec))  # the console names the cause, not only the log
        if cause:
            spec.last_error = f"{decision.reason}: {cause}"
        if isinstance(decision, FailRun):
            spec.state = ComponentState.EXITED
            self.write_status()
            raise RunFailed(f"{decision.message}{': ' + cause if cause else ''}; see {self.log_path(spec)}")
        assert isinstance(decision, ScheduleRestart), decision
        spec.state, spec.due, spec.proc = ComponentState.RESTARTING, decision.at, None
        spec.consecutive_crashes = decision.consecutive_crashes
        self.say(
            f"  [yellow]crashed[/yellow] {spec.name} (pid {spec.pid}) {escape(spec.last_error)}; restart "
            f"{spec.restarts + 1}/{self.cfg.supervisor.max_restarts} in {decision.delay_s:g} s"
        )
        self.write_status()

    def _restart(self, spec: ComponentSpec) -> None:
        spec.restarts += 1
        RESTARTS.labels(spec.name).inc()
        if spec.role == "producer":
            spec.late_join = True  # the weight-broadcast group was formed at start without it
        self._spawn(spec)
        log.info("restarted %s as pid %d (restart %d, after: %s)", spec.name, spec.pid, spec.restarts, spec.last_error)
        self.write_status()

    # -- status files ----------------------------------------------------------------------------

    def health(self) -> tuple[bool, dict]:
        """``/health`` of ``busctl up``: healthy unless the run failed; state, step, live components."""
        return self.outcome != RunOutcome.FAILED, {
            "component": "supervisor",
            "state": self.state,
            "step": self.snapshot.get("step"),
            "components_live": sum(s.state in LIVE_STATES for s in self.table),
            "components": len(self.table),
        }

    def write_status(self) -> None:
        """Write ``status.json`` atomically and keep it as :attr:`snapshot` (fields: :mod:`busctl.run_status`)."""
        stats = self.poller.stats
        empty = {
            "throughput": {"samples_per_s": None, "tokens_per_s": None},
            "busy": None,
            "queue_depth": None,
            "queues": {},
        }
        max_steps = self.final_step
        steps_per_s, eta = self.steps.rate_and_eta(max_steps)
        status = {
            "supervisor_pid": os.getpid(),
            "supervisor_start_ticks": self._start_ticks,
            "run_dir": str(self.run_dir),
            "name": self.cfg.name,
            "state": self.state,
            "outcome": self.outcome,
            "error": self.error,
            "resume": self.resume,
            "updated_at": time.time(),
            "metrics_port": self.metrics_port,
            "step": self.last_step.step if self.last_step else None,
            "max_steps": max_steps,
            "final_step": self.finish.final_step,
            "trainer_metrics": dict(self.last_step.metrics) if self.last_step else {},
            "steps_per_s": steps_per_s,
            "eta_s": eta,
            "first_step_s": self.startup.first_step_s,
            "scale": self.scaling.progress,
            "events": self.events.recent(),
            "failures": self.failures.summary(),
            "components": [{**s.status_row(), "role": s.role, **stats.get(s.name, empty)} for s in self.table],
        }
        write_json_atomic(self.run_dir / "status.json", status)
        self.snapshot = status
        self._status_written = time.monotonic()

    def snapshot_metrics(self) -> None:
        """Save every component's ``/metrics`` text to ``metrics_final/NAME.prom`` (end of run),
        and the supervisor's own to ``metrics_final/supervisor.prom``."""
        snapshot_metrics(
            self.run_dir / "metrics_final", generate_latest(REGISTRY), served_targets(self.table), tls=self._scrape_tls
        )

    def write_scrape_config(self) -> None:
        """Write ``prometheus.yml``: a target per component with a metrics port, at the address it
        reported, and the supervisor's."""
        supervisor = (supervisor_metrics_host(self.cfg), self.metrics_port)
        write_scrape_config(
            self.run_dir / "prometheus.yml",
            self.cfg.name,
            prometheus_targets(self.table, supervisor),
            self.metrics_tls and self.metrics_tls.prometheus_tls_config(),
        )

    # -- shutdown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every component (SIGTERM, then SIGKILL after the grace period); idempotent."""
        if self.ctx.closed:
            return
        self.state = RunState.STOPPING
        self.poller.close()
        stop_all(list(reversed(self.table)))
        for sock in (self._inbox, self._control):
            if sock is not None:
                sock.close()
        self._inbox = self._control = None
        self.finish.close()
        self.scaling.servers.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        self.state = RunState.STOPPED
        if self.run_dir.is_dir():
            self.write_status()
        auth.disable(self.ctx)
        self.ctx.term()
