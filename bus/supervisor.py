"""The supervisor behind ``busctl up``: one table of components, started, watched and stopped.

Lifecycle of a run:

1. ``prepare``: create the run directory (cleared of a previous run's outputs), resolve what the
   config leaves open (the policy path: build or reuse the tiny policy; a free rendezvous port
   for the weight broadcast), write the resolved ``config.yaml`` that every component reads.
2. ``start``: spawn every component of :func:`component_table` as its own process (own process
   group; stdout/stderr to ``logs/NAME.log``) and wait for each one's
   :class:`bus.messages.ComponentReady` handshake on the ``supervisor`` socket, never a sleep.
   A component that exits before it is ready fails the start (its log is named).
3. ``watch``: print one progress line per ``trainer.step`` on the control channel; the run ends
   when the trainer announces ``run.done`` after its last step and final eval. Components stop
   working then but keep serving metrics, which are saved to ``metrics_final/`` (for
   ``bench/``). A component that exits before ``run.done`` fails the run.
4. ``shutdown`` (always, also on SIGINT/SIGTERM): SIGTERM to every process group in reverse
   start order, SIGKILL to whatever is left after ``STOP_TIMEOUT_S``; no process is left behind.

Components also die with the supervisor (``PR_SET_PDEATHSIG``, see :mod:`bus.component`).
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
from rich.console import Console

from bus import auth
from bus.messages import ComponentReady, RunDone, TrainerStep
from bus.sockets import BusSocket
from bus.topics import Endpoints
from configs.schema import RunConfig, dump_config

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 20.0
"""Grace period between SIGTERM and SIGKILL at shutdown, seconds."""

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ComponentSpec:
    """One row of the component table.

    Attributes:
        name: unique name (``"rewards-1"``). module: ``python -m`` entry. index: replica index.
        pid, state, metrics_port: runtime state (``"starting"``, ``"ready"``, ``"exited(N)"``).
    """

    name: str
    module: str
    index: int = 0
    pid: int = 0
    state: str = "not started"
    metrics_port: int = 0
    proc: subprocess.Popen | None = field(default=None, repr=False, compare=False)


def component_table(cfg: RunConfig) -> list[ComponentSpec]:
    """Every process of a run, in start order (the hub first, the prompt source last)."""
    table = [ComponentSpec("hub", "bus.hub"), ComponentSpec("trainer", "trainer.proc"), ComponentSpec("packer", "packer.proc")]
    table += [ComponentSpec(f"rewards-{i}", "rewards.worker", i) for i in range(cfg.rewards.replicas)]
    table += [ComponentSpec(f"producer-{i}", "producers.producer", i) for i in range(cfg.producers.replicas)]
    table.append(ComponentSpec("prompt-source", "producers.prompt_source"))
    return table


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RunFailed(RuntimeError):
    """A component failed to start or died during the run."""


class Supervisor:
    """Starts, watches and stops the processes of one run.

    Args:
        cfg: the run config (``model.path`` and ``broadcast.port`` may be left open).
        console: where progress lines go.
    """

    def __init__(self, cfg: RunConfig, console: Console | None = None) -> None:
        self.cfg = cfg
        self.console = console or Console(soft_wrap=True)
        self.run_dir = Path(cfg.run_dir).resolve()
        self.table = component_table(cfg)
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        auth.enable(self.ctx, auth.keys_from_config(cfg.bus))
        self.endpoints = Endpoints(cfg.bus.transport, self.run_dir, cfg.bus.host, cfg.bus.base_port)
        self.last_step: TrainerStep | None = None
        self.run_done = False

    # -- prepare ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Resolve the config and write the run directory (see module docstring)."""
        for stale in ("metrics.jsonl", "trained_samples.jsonl", "metrics_final", "checkpoints", "logs", "weights", "sock", "status.json"):
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

    def _spawn(self, spec: ComponentSpec, metrics_port: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.setdefault("PYTHONUNBUFFERED", "1")
        cmd = [sys.executable, "-m", spec.module, "--run-dir", str(self.run_dir), "--name", spec.name,
               "--index", str(spec.index), "--metrics-port", str(metrics_port)]
        logfile = open(self.run_dir / "logs" / f"{spec.name}.log", "ab")
        spec.proc = subprocess.Popen(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=os.getcwd(), start_new_session=True)
        logfile.close()
        spec.pid, spec.state = spec.proc.pid, "starting"

    def start(self) -> None:
        """Spawn every component and wait for all ready handshakes.

        Raises:
            RunFailed: a component exited, or was not ready within ``bus.ready_timeout_s``.
        """
        inbox = BusSocket(self.ctx, "supervisor", "recv", self.endpoints.address("supervisor"), bind=True, stop=self.stop, accept=(ComponentReady,))
        try:
            base = self.cfg.metrics.base_port
            for k, spec in enumerate(self.table):
                self._spawn(spec, base + k if base else 0)
            self.write_status()
            by_name = {s.name: s for s in self.table}
            deadline = time.monotonic() + self.cfg.bus.ready_timeout_s
            while any(s.state != "ready" for s in self.table):
                self.check_alive()
                if self.stop.is_set():
                    raise RunFailed("interrupted during start-up")
                if time.monotonic() > deadline:
                    late = [s.name for s in self.table if s.state != "ready"]
                    raise RunFailed(f"not ready after {self.cfg.bus.ready_timeout_s:.0f} s: {late}")
                msg = inbox.recv(timeout_s=0.5)
                if isinstance(msg, ComponentReady) and msg.name in by_name:
                    by_name[msg.name].state, by_name[msg.name].metrics_port = "ready", msg.metrics_port
                    self.console.print(f"  [green]ready[/green] {msg.name} (pid {msg.pid}, metrics :{msg.metrics_port})")
                    self.write_status()
        finally:
            inbox.close()
        self.write_scrape_config()

    def check_alive(self) -> None:
        """Raise :class:`RunFailed` if a component exited (before the run was done)."""
        for spec in self.table:
            code = spec.proc.poll() if spec.proc else None
            if code is None or spec.state.startswith("exited"):
                continue
            spec.state = f"exited({code})"
            self.write_status()
            raise RunFailed(f"{spec.name} exited with code {code}; see {self.run_dir / 'logs' / (spec.name + '.log')}")

    # -- watch -----------------------------------------------------------------------------------

    def watch(self) -> None:
        """Print progress until the trainer announces ``run.done``, then save every component's
        metrics (they keep serving them until shutdown).

        Raises:
            RunFailed: a component exited before the run was done.
        """
        control = BusSocket(self.ctx, "control_sub", "recv", self.endpoints.address("control_sub"), bind=False, stop=self.stop)
        try:
            while not self.stop.is_set() and not self.run_done:
                self._drain(control, first_timeout_s=0.5)
                if not self.run_done:
                    self.check_alive()
            if self.run_done:
                self.snapshot_metrics()
        finally:
            control.close()

    def _drain(self, control: BusSocket, first_timeout_s: float) -> None:
        """Handle every pending control message (waiting up to ``first_timeout_s`` for the first)."""
        msg = control.recv(timeout_s=first_timeout_s)
        while msg is not None:
            if isinstance(msg, TrainerStep) and (self.last_step is None or msg.step > self.last_step.step):
                self.last_step = msg
                self.console.print(self.progress_line(msg))
            elif isinstance(msg, RunDone):
                self.run_done = True
            msg = control.recv(timeout_s=0)

    def progress_line(self, msg: TrainerStep) -> str:
        """``step 12/60 | reward 0.512 | loss ... | tokens/s ... | lag mean/max``."""
        m = msg.metrics
        return (
            f"step {msg.step:>4}/{self.cfg.trainer.max_steps} | reward {m.get('reward_mean', 0):.3f}"
            f" | loss {m.get('loss', 0):+.4f} | kl {m.get('kl', 0):.4f} | {m.get('tokens_per_s', 0):,.0f} tok/s"
            f" | lag {m.get('policy_lag_mean', 0):.2f}/{m.get('policy_lag_max', 0):.0f} | {m.get('step_time_s', 0):.2f} s"
        )

    # -- status files ----------------------------------------------------------------------------

    def write_status(self) -> None:
        """Write ``status.json`` (supervisor pid, components with pid, state, metrics port)."""
        rows = [{"name": s.name, "module": s.module, "index": s.index, "pid": s.pid, "state": s.state,
                 "metrics_port": s.metrics_port} for s in self.table]
        status = {"supervisor_pid": os.getpid(), "run_dir": str(self.run_dir), "components": rows}
        tmp = self.run_dir / "status.json.tmp"
        tmp.write_text(json.dumps(status, indent=1))
        tmp.replace(self.run_dir / "status.json")

    def snapshot_metrics(self) -> None:
        """Save every component's ``/metrics`` text to ``metrics_final/NAME.prom`` (end of run)."""
        out = self.run_dir / "metrics_final"
        out.mkdir(exist_ok=True)
        for spec in self.table:
            if not spec.metrics_port:
                continue
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{spec.metrics_port}/metrics", timeout=2) as resp:
                    (out / f"{spec.name}.prom").write_bytes(resp.read())
            except OSError as exc:
                log.warning("could not scrape %s: %s", spec.name, exc)

    def write_scrape_config(self) -> None:
        """Write ``prometheus.yml``: one scrape target per component's metrics port."""
        targets = [f"127.0.0.1:{s.metrics_port}" for s in self.table if s.metrics_port]
        text = (
            "scrape_configs:\n  - job_name: rlbus\n    scrape_interval: 5s\n    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n        labels: {{run: {json.dumps(self.cfg.name)}}}\n"
        )
        (self.run_dir / "prometheus.yml").write_text(text)

    # -- shutdown --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every component (SIGTERM, then SIGKILL after the grace period); idempotent."""
        if self.ctx.closed:
            return
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
            if not spec.state.startswith("exited"):
                spec.state = f"exited({spec.proc.returncode})"
        self.write_status()
        auth.disable(self.ctx)
        self.ctx.term()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
