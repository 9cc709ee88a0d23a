"""``busctl up`` heals: heartbeats, restarts with backoff and a budget, scaling, resume.

A real :class:`busctl.supervisor.Supervisor` (in a thread of the test, through
:func:`busctl.cli.supervise`, exactly as ``busctl up`` runs it) over real processes: the real
control hub (``bus.hub``) and tiny real components (``tests/busctl/sleepy.py``) in the roles of
reward workers, producers and the packer. Processes are killed with real signals; what the
supervisor did is read from ``status.json``, ``busctl status``/``scale`` and the logs.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import zmq
from rich.console import Console

from busctl import cli as busctl
from bus.component import Component
from bus.messages import ComponentHeartbeat, RunDone, new_id
from bus.sockets import BusSocket
from busctl.components.table import ComponentSpec, describe_exit
from busctl.components.healing import backoff_s
from busctl.scaling import scale_targets
from busctl.launchers import Launcher
from busctl.supervisor import Supervisor
from configs.schema import ConfigError, RunConfig, SupervisorConfig, load_config
from tests.processes import exists

WAIT_S = 60.0
"""Longest a test waits for the supervisor to reach a state (generous: a loaded 2-core host)."""

SLEEPY = "tests.busctl.sleepy"


def make_cfg(run_dir: Path, *overrides: str) -> RunConfig:
    """A run config for sleepy components: fast heartbeats and backoff, no policy, no broadcast port."""
    return load_config(
        None,
        [
            f"run_dir={run_dir}",
            "model.path=unused-by-sleepy",
            "broadcast.method=filesystem",
            "bus.heartbeat_s=0.1",
            "bus.dead_after_s=2",
            "bus.ready_timeout_s=60",
            "supervisor.backoff_initial_s=0.2",
            "supervisor.backoff_max_s=0.4",
            "supervisor.max_restarts=5",
            *overrides,
        ],
    )


def table(*names: str) -> list[ComponentSpec]:
    """The real hub for ``"hub"``, a sleepy component for every other name (``"rewards-1"``: index 1)."""
    specs = []
    for name in names:
        _, _, suffix = name.rpartition("-")
        specs.append(
            ComponentSpec(name, "bus.hub" if name == "hub" else SLEEPY, int(suffix) if suffix.isdigit() else 0)
        )
    return specs


class RunningSupervisor:
    """``busctl up``'s :func:`busctl.cli.supervise` in a thread; console output in ``self.out``."""

    def __init__(
        self, cfg: RunConfig, specs: list[ComponentSpec], *, resume: bool = False, launcher: Launcher | None = None
    ) -> None:
        self.out = io.StringIO()
        console = Console(file=self.out, soft_wrap=True, highlight=False, width=200)
        self.sup = Supervisor(cfg, console, table=specs, resume=resume, launcher=launcher)
        self.run_dir = self.sup.run_dir
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, args=(console,), daemon=True)
        self.thread.start()

    def _run(self, console: Console) -> None:
        self.code = busctl.supervise(self.sup, console)

    def status(self) -> dict:
        return json.loads((self.run_dir / "status.json").read_text())

    def components(self) -> dict[str, dict]:
        return {c["name"]: c for c in self.status()["components"]}

    def wait_for(self, what: str, predicate: Callable[[dict[str, dict]], bool]) -> dict[str, dict]:
        """Poll ``status.json`` until ``predicate(components by name)``; fail naming ``what``."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            try:
                comps = self.components()
            except FileNotFoundError:  # not written yet, or the previous run's, removed by a resume meanwhile
                comps = None
            if comps is not None and predicate(comps):
                return comps
            if not self.thread.is_alive():
                pytest.fail(f"supervisor ended (code {self.code}) before: {what}\n{self.out.getvalue()}")
            time.sleep(0.05)
        pytest.fail(f"not within {WAIT_S} s: {what}\n{self.out.getvalue()}")

    def all_running(self) -> dict[str, dict]:
        return self.wait_for("every component running", lambda c: all(r["state"] == "running" for r in c.values()))

    def join(self) -> int:
        self.thread.join(timeout=WAIT_S)
        assert not self.thread.is_alive(), f"supervisor did not end\n{self.out.getvalue()}"
        return self.code

    def close(self) -> None:
        self.sup.stop.set()
        self.thread.join(timeout=WAIT_S)


@pytest.fixture
def supervisors():
    """``start(cfg, specs, resume=False)`` -> a :class:`RunningSupervisor`; all stopped at teardown."""
    running: list[RunningSupervisor] = []

    def start(
        cfg: RunConfig, specs: list[ComponentSpec], resume: bool = False, launcher: Launcher | None = None
    ) -> RunningSupervisor:
        running.append(RunningSupervisor(cfg, specs, resume=resume, launcher=launcher))
        return running[-1]

    yield start
    for r in running:
        r.close()


def log_text(run_dir: Path, name: str) -> str:
    return (run_dir / "logs" / f"{name}.log").read_text()


def publish_run_done(run: RunningSupervisor) -> None:
    """Announce ``run.done`` on the control channel until the supervisor ends (slow joiner)."""
    ctx = zmq.Context()
    try:
        pub = BusSocket(ctx, "control_pub", "send", run.sup.endpoints.address("control_pub"), bind=False)
        deadline = time.monotonic() + WAIT_S
        while run.thread.is_alive() and time.monotonic() < deadline:
            pub.send(RunDone(id=new_id(), step=1, reason="max_steps"))
            run.thread.join(timeout=0.2)
        pub.close()
    finally:
        ctx.term()


# -- pure logic ------------------------------------------------------------------------------------


def test_backoff_doubles_per_consecutive_crash_up_to_the_cap():
    sup = SupervisorConfig(backoff_initial_s=0.5, backoff_max_s=3.0)
    assert [backoff_s(k, sup) for k in (1, 2, 3, 4, 5, 1000)] == [0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="consecutive_crashes"):
        backoff_s(0, sup)


def test_describe_exit_names_signals_and_codes():
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"


def test_scale_targets_validates_against_the_config(tmp_path):
    cfg = make_cfg(tmp_path, "producers.max_replicas=3")
    assert scale_targets(cfg, {"id": "x", "rewards": 4, "producers": 3}) == {"rewards": 4, "producer": 3}
    for bad, match in [
        ({"producers": 4}, "max_replicas=3"),
        ({"rewards": 0}, ">= 1"),
        ({"rewards": True}, ">= 1"),
        ({"rewards": 1.5}, ">= 1"),
        ({}, "nothing to scale"),
    ]:
        with pytest.raises(ValueError, match=match):
            scale_targets(cfg, bad)


# -- heartbeat of a component ----------------------------------------------------------------------


class Idle(Component):
    def run(self) -> None:
        self.stop.wait()


def test_component_heartbeats_until_closed(tmp_path):
    """A real Component sends `running` heartbeats from its own thread, `done` once its state says
    so, and close() stops the thread before the context terminates."""
    cfg = make_cfg(tmp_path / "run")
    comp = Idle(cfg, "rewards-3", 3)
    comp.endpoints.ensure_dirs()
    ctx = zmq.Context()
    inbox = BusSocket(
        ctx, "supervisor", "recv", comp.endpoints.address("supervisor"), bind=True, accept=(ComponentHeartbeat,)
    )
    try:
        comp.start_heartbeat()
        beats = [inbox.recv(timeout_s=5) for _ in range(3)]
        assert all(isinstance(b, ComponentHeartbeat) for b in beats), beats
        assert {(b.name, b.pid, b.state) for b in beats} == {("rewards-3", os.getpid(), "running")}
        comp.heartbeat_state = "done"
        for _ in range(20):
            beat = inbox.recv(timeout_s=5)
            assert beat is not None
            if beat.state == "done":
                break
        assert beat.state == "done"
        thread = comp._heartbeat_thread
        comp.close()  # ctx.term() would hang if the heartbeat socket were still open
        assert not thread.is_alive()
        while inbox.recv(timeout_s=0.3) is not None:
            pass
        assert inbox.recv(timeout_s=0.5) is None  # silent after close
    finally:
        inbox.close()
        ctx.term()


# -- restarts --------------------------------------------------------------------------------------


def test_killed_components_are_restarted_with_backoff_and_the_run_still_ends(tmp_path, supervisors, capsys, metric):
    run = supervisors(make_cfg(tmp_path / "run"), table("hub", "rewards-0", "producer-0"))
    first = run.all_running()
    before = metric("rlbus_supervisor_restarts_total", component="rewards-0")

    os.kill(first["rewards-0"]["pid"], signal.SIGKILL)
    comps = run.wait_for(
        "rewards-0 restarted once", lambda c: c["rewards-0"]["restarts"] == 1 and c["rewards-0"]["state"] == "running"
    )
    second_pid = comps["rewards-0"]["pid"]
    assert second_pid != first["rewards-0"]["pid"] and not exists(first["rewards-0"]["pid"])
    assert comps["rewards-0"]["consecutive_crashes"] == 1
    assert comps["rewards-0"]["last_error"] == "was killed by SIGKILL"
    assert {n: comps[n]["pid"] for n in ("hub", "producer-0")} == {n: first[n]["pid"] for n in ("hub", "producer-0")}
    assert "RLBUS_RESTARTS=1 " in log_text(run.run_dir, "rewards-0")
    assert "restart 1/5 in 0.2 s" in run.out.getvalue()

    # crashing again right away: the backoff doubles (0.4 s), capped at backoff_max_s afterwards
    os.kill(second_pid, signal.SIGKILL)
    comps = run.wait_for(
        "rewards-0 restarted twice", lambda c: c["rewards-0"]["restarts"] == 2 and c["rewards-0"]["state"] == "running"
    )
    assert comps["rewards-0"]["consecutive_crashes"] == 2
    assert "restart 2/5 in 0.4 s" in run.out.getvalue()
    assert metric("rlbus_supervisor_restarts_total", component="rewards-0") - before == 2
    log = log_text(run.run_dir, "rewards-0")
    assert log.count("===== rlbus") == 3 and "(restart 2)" in log  # appended, one header per start

    # the hub too; a restarted producer joins late (it cannot join a broadcast group formed at start)
    os.kill(comps["hub"]["pid"], signal.SIGKILL)
    os.kill(comps["producer-0"]["pid"], signal.SIGKILL)
    comps = run.wait_for(
        "hub and producer restarted",
        lambda c: all(c[n]["restarts"] == 1 and c[n]["state"] == "running" for n in ("hub", "producer-0")),
    )
    assert "RLBUS_RESTARTS=1 RLBUS_RESUME= RLBUS_LATE_JOIN=1" in log_text(run.run_dir, "producer-0")

    assert busctl.main(["status", str(run.run_dir)]) == 0
    shown = capsys.readouterr().out
    rows = {
        cells[0]: cells
        for line in shown.splitlines()
        if len(cells := [c.strip() for c in re.split("[│┃]", line)[1:-1]]) == 11
    }
    assert rows["component"] == [
        "component",
        "state",
        "pid",
        "alive",
        "restarts",
        "heartbeat",
        "samples/s",
        "tokens/s",
        "busy",
        "queue",
        "metrics port",
    ]
    assert rows["rewards-0"][:5] == ["rewards-0", "running", str(comps["rewards-0"]["pid"]), "yes", "2"]
    assert rows["rewards-0"][5].endswith(" s ago")
    assert rows["rewards-0"][10] == str(comps["rewards-0"]["metrics_port"])
    assert "rewards-0: last crash: was killed by SIGKILL" in shown

    publish_run_done(run)  # through the restarted hub
    assert run.join() == 0, run.out.getvalue()
    status = run.status()
    assert (status["state"], status["outcome"]) == ("stopped", "done")
    assert not any(exists(c["pid"]) for c in status["components"])
    prom = (run.run_dir / "metrics_final" / "supervisor.prom").read_text()
    assert 'rlbus_supervisor_restarts_total{component="rewards-0"}' in prom
    assert f"127.0.0.1:{status['metrics_port']}" in (run.run_dir / "prometheus.yml").read_text()


def test_restart_budget_spent_fails_the_run_naming_component_and_log(tmp_path, supervisors):
    run = supervisors(make_cfg(tmp_path / "run", "supervisor.max_restarts=1"), table("hub", "rewards-0"))
    os.kill(run.all_running()["rewards-0"]["pid"], signal.SIGKILL)
    comps = run.wait_for(
        "one restart", lambda c: c["rewards-0"]["restarts"] == 1 and c["rewards-0"]["state"] == "running"
    )
    os.kill(comps["rewards-0"]["pid"], signal.SIGKILL)
    assert run.join() == 1
    out = run.out.getvalue()
    assert "run failed: rewards-0 was killed by SIGKILL after 1 restarts" in out
    assert "supervisor.max_restarts=1" in out and str(run.run_dir / "logs" / "rewards-0.log") in out
    status = run.status()
    assert status["outcome"] == "failed" and "rewards-0" in status["error"]
    assert not any(exists(c["pid"]) for c in status["components"])


def test_silent_component_is_declared_dead_and_restarted(tmp_path, supervisors):
    """SIGSTOP: the process exists but sends nothing; after bus.dead_after_s it is killed and replaced."""
    run = supervisors(make_cfg(tmp_path / "run"), table("hub", "producer-0", "rewards-0"))
    stopped = run.all_running()["producer-0"]["pid"]
    os.kill(stopped, signal.SIGSTOP)
    try:
        comps = run.wait_for(
            "producer-0 replaced", lambda c: c["producer-0"]["restarts"] == 1 and c["producer-0"]["state"] == "running"
        )
    finally:
        if exists(stopped):
            os.kill(stopped, signal.SIGCONT)
    assert comps["producer-0"]["last_error"].startswith("was silent for ")
    assert "no heartbeat" in comps["producer-0"]["last_error"]
    assert not exists(stopped)  # its whole process group was killed and reaped
    assert comps["rewards-0"]["restarts"] == 0


def test_restarted_component_not_ready_in_time_counts_as_another_crash(tmp_path, supervisors):
    """The restart waits for the handshake without blocking the loop: status.json keeps being
    rewritten while the replacement hangs in setup, and the other components stay as they were."""
    run = supervisors(make_cfg(tmp_path / "run", "bus.ready_timeout_s=8"), table("hub", "rewards-0", "rewards-1"))
    first = run.all_running()
    marker = run.run_dir / "hang-setup-rewards-0"
    marker.touch()
    os.kill(first["rewards-0"]["pid"], signal.SIGKILL)
    run.wait_for(
        "replacement hanging", lambda c: c["rewards-0"]["restarts"] == 1 and c["rewards-0"]["state"] == "starting"
    )
    stamps = set()
    while len(stamps) < 3:  # the loop keeps turning while the replacement is not ready
        status = run.status()
        assert {c["name"]: c["state"] for c in status["components"]}["rewards-0"] in ("starting", "restarting")
        stamps.add(status["updated_at"])
        time.sleep(0.1)
    comps = run.wait_for("not-ready counted as a crash", lambda c: c["rewards-0"]["restarts"] == 2)
    assert comps["rewards-0"]["last_error"] == "was not ready within 8 s"
    marker.unlink()
    comps = run.wait_for("second replacement ready", lambda c: c["rewards-0"]["state"] == "running")
    assert comps["rewards-0"]["consecutive_crashes"] == 2
    assert {n: comps[n]["pid"] for n in ("hub", "rewards-1")} == {n: first[n]["pid"] for n in ("hub", "rewards-1")}


def test_a_killed_packer_is_restarted_like_any_component(tmp_path, supervisors):
    run = supervisors(make_cfg(tmp_path / "run"), table("hub", "packer", "rewards-0"))
    first = run.all_running()
    os.kill(first["packer"]["pid"], signal.SIGKILL)
    comps = run.wait_for(
        "packer restarted", lambda c: c["packer"]["restarts"] == 1 and c["packer"]["state"] == "running"
    )
    assert comps["packer"]["pid"] != first["packer"]["pid"] and comps["rewards-0"]["pid"] == first["rewards-0"]["pid"]
    assert "RLBUS_RESTARTS=1 " in log_text(run.run_dir, "packer")


def test_without_restarts_any_exit_fails_the_run(tmp_path, supervisors):
    run = supervisors(make_cfg(tmp_path / "run", "supervisor.restart=false"), table("hub", "rewards-0"))
    os.kill(run.all_running()["rewards-0"]["pid"], signal.SIGTERM)  # even a clean exit (code 0)
    assert run.join() == 1
    assert "run failed: rewards-0 exited with code 0; see " in run.out.getvalue()


# -- scaling ---------------------------------------------------------------------------------------


def test_busctl_scale_up_and_down_against_the_running_supervisor(tmp_path, supervisors, capsys):
    run = supervisors(make_cfg(tmp_path / "run", "producers.max_replicas=2"), table("hub", "rewards-0", "producer-0"))
    first = run.all_running()
    run_dir = str(run.run_dir)

    assert busctl.main(["scale", run_dir, "rewards=3", "producers=2"]) == 0
    comps = run.components()
    assert sorted(comps) == ["hub", "producer-0", "producer-1", "rewards-0", "rewards-1", "rewards-2"]
    assert all(c["state"] in ("ready", "running") for c in comps.values())
    assert comps["producer-1"]["index"] == 1 and comps["producer-1"]["late_join"]
    assert "RLBUS_LATE_JOIN=1" in log_text(run.run_dir, "producer-1")
    assert "RLBUS_LATE_JOIN=\n" in log_text(run.run_dir, "rewards-2")
    assert {n: comps[n]["pid"] for n in first} == {n: c["pid"] for n, c in first.items()}
    assert "started ['rewards-1', 'rewards-2', 'producer-1']" in capsys.readouterr().out

    # refused without touching the run: past max_replicas, below one, malformed
    assert busctl.main(["scale", run_dir, "producers=3"]) == 2
    assert "producers.max_replicas=2" in capsys.readouterr().err
    assert busctl.main(["scale", run_dir, "rewards=0"]) == 2
    assert busctl.main(["scale", run_dir, "trainers=2"]) == 2
    assert busctl.main(["scale", run_dir, "rewards=two"]) == 2

    assert busctl.main(["scale", run_dir, "rewards=1", "producers=1"]) == 0
    comps = run.components()
    assert sorted(comps) == ["hub", "producer-0", "rewards-0"]
    for name in ("rewards-1", "rewards-2", "producer-1"):
        assert "finished" in log_text(run.run_dir, name)  # stopped gracefully (SIGTERM), not killed
    assert all(c["restarts"] == 0 for c in comps.values())
    assert run.status()["scale"]["state"] == "done"

    run.close()
    assert run.code == 130
    assert busctl.main(["scale", run_dir, "rewards=2"]) == 1  # nobody to talk to
    assert "no running busctl up" in capsys.readouterr().err


# -- resume and the CLI ----------------------------------------------------------------------------


def test_resume_keeps_the_run_directory_and_tells_every_component(tmp_path, supervisors, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "ledger.jsonl").write_text("stale: from an earlier run\n")
    (run_dir / "packer").mkdir()  # an earlier run's spool
    run = supervisors(make_cfg(run_dir, "trainer.max_steps=9"), table("hub", "rewards-0"))
    run.all_running()
    assert not (run_dir / "ledger.jsonl").exists()  # a fresh run starts from an empty run directory
    assert not (run_dir / "packer").exists()
    # a second `busctl up` in the same run directory is refused while the first one runs
    model = tmp_path / "model"  # a model directory, so that the refusal is about the run going on
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    assert busctl.main(["up", f"run_dir={run_dir}", f"model.path={model}"]) == 1
    assert "already going" in capsys.readouterr().err
    run.close()
    assert run.code == 130
    (run_dir / "checkpoints" / "step_3").mkdir(parents=True)
    (run_dir / "checkpoints" / "step_3" / "state.pt").write_bytes(b"weights")
    (run_dir / "metrics.jsonl").write_text('{"step": 3}\n')
    (run_dir / "ledger.jsonl").write_text("issued p-1\n")
    (run_dir / "packer").mkdir()
    (run_dir / "packer" / "spool.bin").write_bytes(b"spooled")

    cfg = busctl.resume_config(str(run_dir), ["trainer.max_steps=12"])
    assert (
        cfg.trainer.max_steps == 12 and cfg.run_dir == str(run_dir.resolve()) and cfg.model.path == "unused-by-sleepy"
    )
    resumed = supervisors(cfg, table("hub", "rewards-0"), resume=True)
    resumed.all_running()
    assert (run_dir / "checkpoints" / "step_3" / "state.pt").read_bytes() == b"weights"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 3}\n'
    assert (run_dir / "ledger.jsonl").read_text() == "issued p-1\n"
    assert (run_dir / "packer" / "spool.bin").read_bytes() == b"spooled"
    log = log_text(run_dir, "rewards-0")
    assert log.count("===== rlbus") == 2 and "(resume)" in log  # appended
    assert "RLBUS_RESTARTS= RLBUS_RESUME=1 " in log
    assert resumed.status()["resume"] is True
    assert load_config(run_dir / "config.yaml").trainer.max_steps == 12


def test_busctl_up_resume_cli(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert busctl.main(["up", "--resume", str(run_dir), "--dry-run"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    assert busctl.main(["up", "--resume", str(tmp_path / "missing")]) == 2
    # a saved config (as a run writes it) from a run directory that has since been moved here
    model = tmp_path / "model"  # --dry-run checks the model directory as busctl up does
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    (run_dir / "config.yaml").write_text(
        f"run_dir: /somewhere/else\nmodel:\n  path: {model}\nbroadcast:\n  port: 29511\n"
    )
    capsys.readouterr()
    assert busctl.main(["up", "--resume", str(run_dir), "trainer.max_steps=7", "--dry-run"]) == 0
    resolved = capsys.readouterr().out
    assert "max_steps: 7" in resolved and "port: 0" in resolved and f"run_dir: {run_dir.resolve()}" in resolved
    assert f"path: {model}" in resolved
    assert busctl.main(["up", "--resume", str(run_dir), f"run_dir={tmp_path}", "--dry-run"]) == 2
    assert "run_dir cannot be overridden" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="trainer.max_stepz"):
        busctl.resume_config(str(run_dir), ["trainer.max_stepz=3"])


def test_busctl_status_without_a_run(tmp_path, capsys):
    assert busctl.main(["status", str(tmp_path)]) == 1
    assert "no run at" in capsys.readouterr().err
