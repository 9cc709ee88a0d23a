"""What a running ``busctl up`` tells others: ``prometheus.yml``, throughput/busy/queue columns in
``status.json`` and ``busctl status``, its live display.

A real :class:`busctl.supervisor.Supervisor` (through :func:`busctl.cli.supervise`, in a thread, on a
console that is a terminal, so the live display runs) over real processes: the real control hub
and :mod:`tests.terminal.ticker` components, which keep real stage meters busy at a known pace.
``busctl status`` and ``busctl scale`` run as separate processes, as from another terminal.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from busctl import cli as busctl
from busctl.components.table import ComponentSpec
from busctl.live import render_text
from busctl.scrape import scrape
from busctl.supervisor import REPO_ROOT, Supervisor
from configs.schema import RunConfig, load_config
from tests.socket_dirs import remove_outside_socket_dir
from tests.terminal.ticker import QUEUED, TOKENS_PER_SAMPLE
from tests.waiting import wait_until

WAIT_S = 60.0
"""Longest a test waits for the supervisor to reach a state (a loaded 2-core host)."""


def make_cfg(run_dir: Path) -> RunConfig:
    """Ticker components: fast heartbeats, no policy, no broadcast port."""
    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            "name=ticks",
            "model.path=unused-by-ticker",
            "broadcast.method=filesystem",
            "bus.heartbeat_s=0.1",
            "bus.dead_after_s=5",
            "bus.ready_timeout_s=60",
            "producers.max_replicas=2",
        ],
    )


def ticker_table(*names: str) -> list[ComponentSpec]:
    """The real hub for ``"hub"``, a ticker for every other name."""
    return [
        ComponentSpec(n, "bus.hub" if n == "hub" else "tests.terminal.ticker", int(n[-1]) if n[-1].isdigit() else 0)
        for n in names
    ]


class TerminalRun:
    """``busctl up``'s :func:`busctl.cli.supervise` in a thread, on a terminal console writing to ``out``."""

    def __init__(self, cfg: RunConfig, specs: list[ComponentSpec]) -> None:
        self.out = io.StringIO()
        self.console = Console(file=self.out, force_terminal=True, width=160, highlight=False, soft_wrap=True)
        self.sup = Supervisor(cfg, self.console, table=specs)
        self.run_dir = self.sup.run_dir
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = busctl.supervise(self.sup, self.console)

    def status(self) -> dict:
        return json.loads((self.run_dir / "status.json").read_text())

    def rows(self) -> dict[str, dict]:
        return {c["name"]: c for c in self.status()["components"]}

    def wait_rows(self, what: str, predicate) -> dict[str, dict]:
        def check():
            assert self.thread.is_alive(), f"supervisor ended (code {self.code}) before: {what}\n{self.out.getvalue()}"
            return (self.run_dir / "status.json").exists() and predicate(rows := self.rows()) and rows

        return wait_until(check, what, WAIT_S)

    def close(self) -> int | None:
        self.sup.stop.set()
        self.thread.join(timeout=WAIT_S)
        return self.code


@pytest.fixture
def terminal_run(tmp_path):
    runs: list[TerminalRun] = []

    def start(specs: list[ComponentSpec]) -> TerminalRun:
        runs.append(TerminalRun(make_cfg(tmp_path / "run"), specs))
        return runs[-1]

    yield start
    for r in runs:
        r.close()
    remove_outside_socket_dir(tmp_path / "run")


def busctl_cli(*args: str) -> subprocess.CompletedProcess:
    """``busctl ARGS`` as its own process (another terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "busctl", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=WAIT_S
    )


def table_rows(text: str, columns: int) -> dict[str, list[str]]:
    """Rows of a rich table in ``text`` with ``columns`` cells, by first cell."""
    return {
        cells[0]: cells
        for line in text.splitlines()
        if len(cells := [c.strip() for c in re.split("[│┃]", line)[1:-1]]) == columns
    }


def measured(row: dict) -> bool:
    return (row["throughput"]["samples_per_s"] or 0) > 0 and row["busy"] is not None


def test_status_scrape_config_and_live_display_of_a_running_supervisor(terminal_run):
    run = terminal_run(ticker_table("hub", "producer-0", "rewards-0"))
    rows = run.wait_rows("both stages measured", lambda r: all(measured(r[n]) for n in ("producer-0", "rewards-0")))
    status = run.status()

    # status.json: the poller's rates of the tickers' real counters
    for name in ("producer-0", "rewards-0"):
        row = rows[name]
        tp = row["throughput"]
        assert tp["tokens_per_s"] / tp["samples_per_s"] == pytest.approx(TOKENS_PER_SAMPLE, rel=0.25)
        assert 0.3 < row["busy"] < 1.0  # 0.75 by the ticker's pace; timing on a loaded host is loose
        assert row["queues"] == {f"{t}/{q}": n for (t, q), n in QUEUED.items()}
        assert row["queue_depth"] == sum(QUEUED.values())
    assert rows["hub"]["throughput"] == {"samples_per_s": None, "tokens_per_s": None}  # no stage: unknown, not 0
    assert rows["hub"]["role"] == "hub" and rows["producer-0"]["role"] == "producer"
    assert status["max_steps"] == make_cfg(Path("x")).trainer.max_steps and status["step"] is None
    assert [text for _, text in status["events"]].count(
        "ready hub (pid {}, metrics :{})".format(rows["hub"]["pid"], rows["hub"]["metrics_port"])
    ) == 1

    # prometheus.yml: one static config per component and the supervisor, labelled
    prom = yaml.safe_load((run.run_dir / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert (job["job_name"], job["scrape_interval"]) == ("rlbus", "5s")
    got = {c["labels"]["component"]: (c["labels"], c["targets"]) for c in job["static_configs"]}
    want = {
        n: ({"run": "ticks", "component": n, "role": r["role"]}, [f"127.0.0.1:{r['metrics_port']}"])
        for n, r in rows.items()
    }
    want["supervisor"] = (
        {"run": "ticks", "component": "supervisor", "role": "supervisor"},
        [f"127.0.0.1:{status['metrics_port']}"],
    )
    assert got == want

    # the supervisor's own metrics: a restarts series per component from its spawn on (the value is
    # the whole test process's count: earlier supervisor tests in it restart components of these names)
    own = scrape(status["metrics_port"]).samples["rlbus_supervisor_restarts_total"]
    restarts = {labels["component"]: value for labels, value in own}
    assert all(restarts.get(n) is not None for n in rows), restarts
    assert all(r["restarts"] == 0 for r in rows.values())

    # `busctl status` from another process: throughput, busy and queue columns
    shown = busctl_cli("status", str(run.run_dir))
    assert shown.returncode == 0, shown.stderr
    cells = table_rows(shown.stdout, 11)
    assert cells["component"][6:10] == ["samples/s", "tokens/s", "busy", "queue"]
    producer = cells["producer-0"]
    assert float(producer[6].replace(",", "")) > 0 and float(producer[7].replace(",", "")) > 0
    assert producer[8].endswith("%") and producer[9] == str(sum(QUEUED.values()))
    assert cells["hub"][6:10] == ["-", "-", "-", "-"]
    assert "step -/" in shown.stdout

    # the live display's renderer on that status
    text = render_text(status)
    assert "ticks running | step -/" in text
    drawn = table_rows(text, 7)
    assert drawn["producer-0"][1] == "running" and drawn["producer-0"][5] == str(sum(QUEUED.values()))
    assert float(drawn["producer-0"][2].replace(",", "")) > 0

    # scaling rewrites the scrape config
    scaled = busctl_cli("scale", str(run.run_dir), "rewards=2")
    assert scaled.returncode == 0, scaled.stdout + scaled.stderr
    run.wait_rows("rewards-1 measured", lambda r: "rewards-1" in r and measured(r["rewards-1"]))
    prom = yaml.safe_load((run.run_dir / "prometheus.yml").read_text())
    labels = [c["labels"] for c in prom["scrape_configs"][0]["static_configs"]]
    assert {"run": "ticks", "component": "rewards-1", "role": "rewards"} in labels

    assert run.close() == 130
    # the live display ran on the terminal console: its table, with the event lines above it
    out = run.out.getvalue()
    assert "samples/s" in out and "tokens/s" in out and "busy" in out
    assert "ready producer-0" in out and "scaled to {'rewards': 2}" in out
