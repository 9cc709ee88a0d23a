"""The files a running ``busctl up`` keeps for others, and what a new run clears of a previous one's.

``status.json`` (rewritten atomically while the run goes on; its fields are written by
:meth:`busctl.supervisor.Supervisor.write_status`: the supervisor's pid, state, outcome, step, ETA, recent
events, and per component its state, restarts, heartbeat, metrics address and the poller's throughput, busy
fraction and queue depths), ``prometheus.yml`` (job ``rlbus``, one target per component and one for the
supervisor, labelled ``run``, ``component``, ``role``), ``metrics_final/`` and ``stages.jsonl``; also the
step clock and event log behind the progress display.
"""

from __future__ import annotations

import json
import logging
import shutil
import ssl
import time
from collections import deque
from enum import StrEnum
from pathlib import Path

import yaml
from rich.text import Text

from runfiles.durable import write_json_atomic, write_text_atomic  # noqa: F401 - re-exported (supervisor, startup)
from busctl.scrape import fetch_metrics

log = logging.getLogger(__name__)

SCRAPE_INTERVAL = "5s"
"""How often the generated Prometheus config scrapes every target."""

STEP_WINDOW = 10
"""Steps the ETA's step rate is measured over (the most recent ones)."""

EVENTS_KEPT = 20
"""Recent events kept for ``status.json`` and the live display."""


class RunState(StrEnum):
    """The supervisor's own state (``status.json``'s ``state``, its ``/health``)."""

    PREPARING = "preparing"
    STARTING = "starting"
    """Components spawned, ready handshakes awaited (``busctl scale`` is accepted from here on)."""
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class RunOutcome(StrEnum):
    """How ``busctl up`` ended (``status.json``'s ``outcome``; ``""`` while it runs)."""

    DONE = "done"
    FAILED = "failed"
    INTERRUPTED = "interrupted"


RUN_OUTPUTS = (
    "metrics.jsonl",
    "stages.jsonl",
    "trained_samples.jsonl",
    "ledger.jsonl",
    "accounting.json",
    "samples.jsonl",
    "report",
    "metrics_final",
    "checkpoints",
    "packer",
    "logs",
    "weights",
    "sock",
    "status.json",
    "scale.json",
    "finish.json",
    "prometheus.yml",
    "trackers",
    "tensorboard",
    "wandb",
    "mlruns",
)
"""Removed from the run directory by a fresh ``busctl up`` (files or directories); a directory of only these names
counts as a run's for ``--overwrite`` (:mod:`busctl.run_dir`)."""

TRANSIENT_OUTPUTS = ("metrics_final", "weights", "sock", "status.json", "scale.json", "finish.json", "prometheus.yml")
"""Removed by ``busctl up --resume`` too: nothing a resumed run continues from."""


def clear_run_dir(run_dir: Path, resume: bool) -> None:
    """Remove a previous run's outputs from ``run_dir``: :data:`RUN_OUTPUTS`, or with ``resume`` only
    :data:`TRANSIENT_OUTPUTS`; ``busctl up`` has already refused an occupied ``run_dir`` unless ``--overwrite``."""
    for stale in TRANSIENT_OUTPUTS if resume else RUN_OUTPUTS:
        target = run_dir / stale
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


def scrape_config(run: str, targets: list[tuple[str, str, str, int]], tls_config: dict | None = None) -> dict:
    """The Prometheus configuration of a run: job ``rlbus`` (``https`` with ``tls_config`` when given), one static
    config per ``(component, role, host, metrics_port)`` of ``targets`` with a port, labelled ``run``,
    ``component`` and ``role``."""
    statics = [
        {"targets": [f"{host}:{port}"], "labels": {"run": run, "component": name, "role": role}}
        for name, role, host, port in targets
        if port
    ]
    job = {"job_name": "rlbus", "scrape_interval": SCRAPE_INTERVAL}
    if tls_config:
        job |= {"scheme": "https", "tls_config": tls_config}
    return {"scrape_configs": [{**job, "static_configs": statics}]}


def append_stage_record(path: Path, step: int, stats: dict[str, dict], roles: dict[str, str]) -> None:
    """Append one line to ``stages.jsonl`` (read by ``busctl report``): ``{"time": unix s, "step": steps done,
    "components": {name: {"role", "throughput", "busy", "queue_depth"}}}``; an I/O error is logged, not raised."""
    components = {
        name: {"role": roles.get(name, name), **{k: stat.get(k) for k in ("throughput", "busy", "queue_depth")}}
        for name, stat in stats.items()
    }
    try:
        with path.open("a") as f:
            f.write(json.dumps({"time": time.time(), "step": step, "components": components}) + "\n")
    except OSError as err:
        log.warning("could not append to %s: %s", path, err)


def write_scrape_config(
    path: Path, run: str, targets: list[tuple[str, str, str, int]], tls_config: dict | None = None
) -> None:
    """Write :func:`scrape_config` as YAML to ``path`` atomically (:func:`write_text_atomic`)."""
    write_text_atomic(path, yaml.safe_dump(scrape_config(run, targets, tls_config), sort_keys=False))


def snapshot_metrics(
    out: Path,
    own: bytes,
    targets: list[tuple[str, str, int]],
    timeout_s: float = 2.0,
    tls: ssl.SSLContext | None = None,
) -> None:
    """Save each ``(name, host, port)``'s ``/metrics`` to ``out/NAME.prom`` and ``own`` (the supervisor's) to
    ``out/supervisor.prom``; a component that does not answer is logged and skipped."""
    out.mkdir(exist_ok=True)
    (out / "supervisor.prom").write_bytes(own)
    for name, host, port in targets:
        try:
            (out / f"{name}.prom").write_bytes(fetch_metrics(port, host, timeout_s, tls))
        except OSError as exc:
            log.warning("could not scrape %s: %s", name, exc)


def eta_s(history: list[tuple[float, int]], max_steps: int) -> tuple[float | None, float | None]:
    """``(steps_per_s, eta_s)`` from ``history`` (``(time_s, step)``, oldest first): the rate between the first and
    last step and ``(max_steps - last step) / rate``; ``(None, None)`` with fewer than two steps or no time between."""
    if len(history) < 2:
        return None, None
    (t0, s0), (t1, s1) = history[0], history[-1]
    if t1 <= t0 or s1 <= s0:
        return None, None
    rate = (s1 - s0) / (t1 - t0)
    return rate, max(0, max_steps - s1) / rate


class StepClock:
    """Monotonic times of the last :data:`STEP_WINDOW` trainer steps, for the ETA."""

    def __init__(self) -> None:
        self.history: deque[tuple[float, int]] = deque(maxlen=STEP_WINDOW)

    def step(self, step: int, now: float | None = None) -> None:
        """Record that ``step`` finished at ``now`` (default ``time.monotonic()``)."""
        self.history.append((time.monotonic() if now is None else now, step))

    def rate_and_eta(self, max_steps: int) -> tuple[float | None, float | None]:
        """:func:`eta_s` of the recorded steps."""
        return eta_s(list(self.history), max_steps)


class EventLog:
    """The last :data:`EVENTS_KEPT` supervisor events: ``[unix time, plain text]`` (rich markup stripped)."""

    def __init__(self) -> None:
        self.events: deque[list] = deque(maxlen=EVENTS_KEPT)

    def add(self, markup: str, now: float | None = None) -> None:
        """Record one event line (rich markup allowed; stored as plain text)."""
        self.events.append([time.time() if now is None else now, Text.from_markup(markup.strip()).plain])

    def recent(self) -> list[list]:
        """A copy of the kept events, oldest first."""
        return [list(e) for e in self.events]
