"""Launch to first optimizer step: ``startup.json``, its console line and ``busctl report``'s line.

The supervisor part runs a real :class:`busctl.supervisor.Supervisor` over the real hub and tiny
real components (as :mod:`tests.busctl.test_supervisor`) and announces a real
:class:`bus.messages.TrainerStep` through the hub, as the trainer does after its first step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import zmq

from bus.messages import TrainerStep, new_id
from bus.sockets import BusSocket
from busctl.components.table import ComponentSpec
from busctl.report import format_summary, summarize
from busctl.run_data import load_run
from busctl.startup import STARTUP_FILE, StartupClock, process_started_at
from tests.busctl.test_supervisor import WAIT_S, make_cfg, publish_run_done, supervisors, table  # noqa: F401 - a fixture

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
"""One clock tick, seconds: a process start time (and /proc/uptime) is known to a tick."""


def test_process_started_at_is_the_spawn_time_on_the_wall_clock():
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        after = time.time()
        started = process_started_at(child.pid)
        assert started is not None and before - 2 * TICK_S <= started <= after + 2 * TICK_S
    finally:
        child.kill()
        child.wait()
    assert process_started_at(child.pid) is None  # gone (reaped)
    assert process_started_at(os.getpid()) <= before


def test_record_writes_every_components_spawn_and_ready_time_since_launch(tmp_path):
    clock = StartupClock(tmp_path, launched_at=time.time() - 10.0)  # launched 10 s ago
    now = time.monotonic()
    ready = ComponentSpec("producer-0", "producers.proc", spawned_at=now - 9.0, ready_at=now - 2.0)
    starting = ComponentSpec("trainer", "trainer.proc", spawned_at=now - 8.5)
    line = clock.record(1, [ready, starting])
    saved = json.loads((tmp_path / STARTUP_FILE).read_text())
    assert saved["first_step"] == 1 and saved["first_step_s"] == clock.first_step_s >= 10.0
    producer, trainer = saved["components"]["producer-0"], saved["components"]["trainer"]
    assert abs(producer["spawned_s"] - 1.0) < 0.5 and abs(producer["ready_s"] - 8.0) < 0.5
    assert trainer["ready_s"] is None and abs(trainer["spawned_s"] - 1.5) < 0.5
    assert f"first optimizer step {clock.first_step_s:.1f} s after launch; last ready: producer-0 at 8.0 s" in line


def test_supervisor_records_the_first_step_and_spawns_producers_first(tmp_path, supervisors):
    run = supervisors(make_cfg(tmp_path / "run"), table("hub", "rewards-0", "producer-0"))
    run.all_running()
    ctx = zmq.Context()
    try:
        pub = BusSocket(ctx, "control_pub", "send", run.sup.endpoints.address("control_pub"), bind=False)
        deadline = time.monotonic() + WAIT_S
        while not (run.run_dir / STARTUP_FILE).exists() and time.monotonic() < deadline:
            pub.send(TrainerStep(id=new_id(), step=1, version=1, metrics={}))  # until the hub forwards it (slow joiner)
            time.sleep(0.1)
        pub.close()
    finally:
        ctx.term()
    saved = json.loads((run.run_dir / STARTUP_FILE).read_text())
    # a component restarted before the first step (a missed heartbeat on a loaded host) was spawned
    # again later: the order is that of the components spawned once
    restarted = {name for name, c in run.components().items() if c["restarts"]}
    spawned = {name: c["spawned_s"] for name, c in saved["components"].items() if name not in restarted}
    if "producer-0" in spawned:
        assert spawned["producer-0"] <= min(spawned.values()), (spawned, run.out.getvalue())
    assert all(c["spawned_s"] <= c["ready_s"] <= saved["first_step_s"] for c in saved["components"].values())
    assert run.status()["first_step_s"] == saved["first_step_s"]
    assert f"first optimizer step {saved['first_step_s']:.1f} s after launch" in run.out.getvalue()
    publish_run_done(run)
    assert run.join() == 0, run.out.getvalue()


def test_report_prints_launch_to_first_step(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5, "step_time_s": 1.0}) + "\n")
    run = load_run(tmp_path)
    assert "launch to first optimizer step: n/a s" in format_summary(run, summarize(run), [])
    (tmp_path / STARTUP_FILE).write_text(json.dumps({"first_step_s": 18.4}))
    run = load_run(tmp_path)
    assert "launch to first optimizer step: 18.4 s" in format_summary(run, summarize(run), [])
