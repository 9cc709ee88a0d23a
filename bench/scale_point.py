"""One point of the scale simulation: start a run, watch it, tear it down (:func:`run_point`).

Real processes, started as ``busctl up`` starts them (``python -m MODULE --run-dir D --name N``):
the control hub (:mod:`bus.hub`), the prompt source (:mod:`prompts.proc`, ledger and accounting
included) and the packer (:mod:`packer.proc`, spool included). Simulated ones
(:mod:`bench.scale_workers`): one process of N producers, one of M reward workers, one trainer.
This module plays the supervisor's part for the handshake: it binds the ``supervisor`` PULL socket
and takes every real component's ``ComponentReady`` (its metrics port) and heartbeats.

While the run goes, every :data:`SAMPLE_S` seconds it samples each process's RSS and CPU time
(``/proc/PID/status``, ``/proc/PID/stat``) and the real components' queue gauges
(``rlbus_bus_queued_messages`` and ``rlbus_bus_queued_bytes{topic, queue}``, scraped from their ``/metrics``).
Results go to :mod:`bench.scale_stats`.

Invariant: every process started here is stopped here (SIGTERM, then SIGKILL after
:data:`STOP_GRACE_S`), also when the point fails or times out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import zmq

from bench.scale_sim import SimSpec
from bus.codec import decode
from bus.messages import ComponentReady
from bus.topics import Endpoints
from configs.schema import dump_config, load_config

SAMPLE_S = 0.5
"""Sampling period of RSS, CPU and queue gauges, seconds."""

STOP_GRACE_S = 10.0
"""SIGTERM to SIGKILL, seconds."""

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
QUEUED = re.compile(r"^rlbus_bus_queued_(messages|bytes)\{(.*)\} (\S+)$")
LABEL = re.compile(r'(\w+)="([^"]*)"')
REAL = {"hub": "bus.hub", "prompt-source": "prompts.proc", "packer": "packer.proc"}


def write_run(
    run_dir: Path,
    *,
    producers: int,
    rewards: int,
    spec: SimSpec,
    max_steps: int,
    prompts_per_step: int,
    max_async_level: int = 1,
) -> None:
    """A fresh ``run_dir`` with ``config.yaml`` (the default job's config with the sweep point's
    sizes, eval off, ``trainer.checkpoint_interval`` 0) and ``sim_spec.json``.

    Raises:
        configs.schema.ConfigError: the point does not make a valid config (e.g. > 64 producers).
    """
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    longest = spec.max_tokens + spec.prompt_tokens
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            f"producers.replicas={producers}",
            f"producers.max_replicas={producers}",
            f"producers.group_size={spec.group_size}",
            f"rewards.replicas={rewards}",
            f"trainer.batch_size={prompts_per_step * spec.group_size}",
            f"trainer.max_steps={max_steps}",
            f"max_async_level={max_async_level}",
            "eval.enabled=false",
            "trainer.checkpoint_interval=0",
            f"packer.micro_batch_tokens={max(longest, 4096)}",
            f"model.max_model_len={longest}",
            f"sampling.max_tokens={spec.max_tokens}",
            "model.path=sim",
        ],
    )
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    (run_dir / "sim_spec.json").write_text(
        json.dumps({**asdict(spec), "max_steps": max_steps, "num_producers": producers})
    )


def _proc_sample(pid: int) -> tuple[int, float] | None:
    """(RSS bytes, CPU seconds user+system) of ``pid``; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None
    return rss, (int(stat[11]) + int(stat[12])) / CLK_TCK


def _scrape_queues(port: int) -> dict[str, float]:
    """``{"topic/queue": messages}`` and ``{"topic/queue:bytes": bytes}`` from a component's
    ``/metrics`` (empty if unreachable)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        m = QUEUED.match(line)
        if m:
            labels = dict(LABEL.findall(m.group(2)))
            unit = ":bytes" if m.group(1) == "bytes" else ""
            out[f"{labels.get('topic')}/{labels.get('queue')}{unit}"] = float(m.group(3))
    return out


class PointRun:
    """The processes of one point and what was sampled of them (see the module docstring)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        cfg = load_config(run_dir / "config.yaml")
        self.cfg = cfg
        self.ctx = zmq.Context()
        endpoints = Endpoints(cfg.bus.transport, run_dir, cfg.bus.host, cfg.bus.base_port)
        endpoints.ensure_dirs()
        self.supervisor = self.ctx.socket(zmq.PULL)
        self.supervisor.bind(endpoints.address("supervisor"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.memory: dict[str, list[int]] = {}
        self.cpu: dict[str, float] = {}
        self.queues: dict[str, float] = {}  # most messages per queue
        self.queue_bytes: dict[str, float] = {}  # most bytes per queue
        (run_dir / "logs").mkdir(exist_ok=True)

    def spawn(self, name: str, args: list[str]) -> None:
        """Start ``python -m args...`` as component ``name`` (log in ``logs/NAME.log``)."""
        log = open(self.run_dir / "logs" / f"{name}.log", "ab")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        log.close()

    def start(self, producers: int, rewards: int, per_process: int = 16, ready_timeout_s: float = 120.0) -> None:
        """Start the real components (waiting for each one's handshake, hub first), then the
        simulated ones, at most ``per_process`` workers per process (``sim-producers-K``,
        ``sim-rewards-K``: K counts processes).

        Raises:
            RuntimeError: a real component did not report ready in ``ready_timeout_s`` or died.
        """
        d = str(self.run_dir)
        for name, module in REAL.items():
            self.spawn(name, [module, "--run-dir", d, "--name", name])
            self._await_ready(name, ready_timeout_s)
        self.spawn("sim-trainer", ["bench.scale_workers", "--run-dir", d, "--role", "trainer"])
        for role, total in (("rewards", rewards), ("producers", producers)):
            for k, first in enumerate(range(0, total, per_process)):
                count = min(per_process, total - first)
                self.spawn(
                    f"sim-{role}-{k}",
                    [
                        "bench.scale_workers",
                        "--run-dir",
                        d,
                        "--role",
                        role,
                        "--first",
                        str(first),
                        "--count",
                        str(count),
                    ],
                )

    def _await_ready(self, name: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while name not in self.ports:
            if time.monotonic() > deadline or self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} did not start (see {self.run_dir}/logs/{name}.log)")
            self._drain_supervisor(200)

    def _drain_supervisor(self, timeout_ms: int) -> None:
        if self.supervisor.poll(timeout_ms):
            while self.supervisor.poll(0):
                msg = decode(self.supervisor.recv_multipart(copy=False))
                if isinstance(msg, ComponentReady):
                    self.ports[msg.name] = msg.metrics_port

    def sample(self) -> None:
        """One sample of RSS, CPU time and queue depths (maxima and latest kept)."""
        self._drain_supervisor(0)
        for name, proc in self.procs.items():
            got = _proc_sample(proc.pid)
            if got is not None:
                self.memory.setdefault(name, []).append(got[0])
                self.cpu[name] = got[1]
        for name, port in self.ports.items():
            for key, depth in _scrape_queues(port).items():
                into = self.queue_bytes if key.endswith(":bytes") else self.queues
                k = f"{name}:{key.removesuffix(':bytes')}"
                into[k] = max(into.get(k, 0.0), depth)

    def wait(self, timeout_s: float) -> tuple[bool, float]:
        """Sample until the simulated trainer exits (the run is done) or ``timeout_s``; returns
        (finished, wall seconds from the start of the simulated workers)."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            self.sample()
            if self.procs["sim-trainer"].poll() is not None:
                return self.procs["sim-trainer"].returncode == 0, time.monotonic() - started
            if any(p.poll() not in (None, 0) or (p.poll() == 0 and n in REAL) for n, p in self.procs.items()):
                return False, time.monotonic() - started  # a component died: the point failed
            time.sleep(SAMPLE_S)
        return False, time.monotonic() - started

    def stop(self) -> None:
        """SIGTERM every process, SIGKILL what is left after :data:`STOP_GRACE_S`; close the socket."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.supervisor.close(linger=0)
        self.ctx.term()


def run_point(
    run_dir: Path,
    *,
    producers: int,
    rewards: int,
    spec: SimSpec,
    max_steps: int,
    prompts_per_step: int,
    timeout_s: float = 300.0,
    per_process: int = 16,
) -> dict:
    """Run one sweep point in ``run_dir`` (simulated workers ``per_process`` to a process) and
    return its raw measurements: ``finished``,
    ``wall_s``, ``rss_max`` / ``rss_last`` (bytes per process), ``cpu_s`` (per process),
    ``queues_max`` (``"component:topic/queue" -> messages``), ``queue_bytes_max`` (the same keys
    -> bytes); the events stay in ``run_dir/sim``."""
    write_run(
        run_dir, producers=producers, rewards=rewards, spec=spec, max_steps=max_steps, prompts_per_step=prompts_per_step
    )
    run = PointRun(run_dir)
    try:
        run.start(producers, rewards, per_process)
        cpu0 = {}
        run.sample()
        cpu0.update(run.cpu)
        finished, wall = run.wait(timeout_s)
        time.sleep(1.5)  # the prompt source records the last outcomes and writes accounting.json on run.done
        run.sample()
    finally:
        run.stop()
    return {
        "finished": finished,
        "wall_s": wall,
        "rss_max": {k: max(v) for k, v in run.memory.items()},
        "rss_last": {k: v[-1] for k, v in run.memory.items()},
        "cpu_s": {k: v - cpu0.get(k, 0.0) for k, v in run.cpu.items()},
        "queues_max": run.queues,
        "queue_bytes_max": run.queue_bytes,
    }
