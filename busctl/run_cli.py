"""The ``busctl`` commands on a run that exists: ``status``, ``logs``, ``down`` and ``scale``, and
the reading of a run directory's ``status.json`` that ``up`` shares (is its ``busctl up`` alive?).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import uuid
from pathlib import Path

from rich.console import Console

from busctl.stderr import print_error

# the config and status modules are imported where used: every busctl command (--help too) imports this one


def split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [overrides...]``: the first argument is a config path unless it has ``=``."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def _run_dir(arg: str | None) -> Path:
    """The run directory a command names, or the default config's ``run_dir`` when it names none."""
    from configs.schema import load_config

    return Path(arg) if arg else Path(load_config(None).run_dir)


class NoRun(Exception):
    """A command needs a run directory with a ``status.json`` and it has none."""


def read_status(run_dir: Path) -> dict:
    """``RUN_DIR/status.json`` as a dict.

    Raises:
        NoRun: the run directory has no ``status.json``.
    """
    path = run_dir / "status.json"
    if not path.is_file():
        raise NoRun(f"no run at {run_dir} (missing {path}); start one with `busctl up`")
    return json.loads(path.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def supervisor_alive(status: dict) -> bool:
    """Is the ``busctl up`` that wrote ``status`` still running (same pid, same process start time)?"""
    from busctl.components.table import process_start_ticks

    pid = status.get("supervisor_pid") or 0
    if not pid or not _alive(pid):
        return False
    recorded = status.get("supervisor_start_ticks")
    return recorded is None or process_start_ticks(pid) in (None, recorded)


def _age(timestamp: float | None) -> str:
    return "-" if timestamp is None else f"{max(0.0, time.time() - timestamp):.1f} s ago"


def cmd_status(ns: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    from busctl.live import format_busy, format_queue, format_rate, trainer_text

    run_dir = _run_dir(ns.run_dir)
    status = read_status(run_dir)
    sup_alive = supervisor_alive(status)
    state = status.get("state", "?") if sup_alive else "not running"
    outcome = f", outcome {status['outcome']}" if status.get("outcome") else ""
    console.print(
        f"{status['run_dir']}: busctl up pid {status['supervisor_pid']} {state}{outcome}"
        + (f", supervisor metrics :{status['metrics_port']}" if status.get("metrics_port") else "")
    )
    from busctl.throughput import run_throughput_text

    console.print(trainer_text(status, eta=sup_alive and status.get("state") not in ("stopping", "stopped")))
    console.print(run_throughput_text(run_dir), markup=False, highlight=False)  # the figures busctl report prints
    table = Table()
    for col in (
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
    ):
        table.add_column(
            col, no_wrap=True, justify="right" if col in ("samples/s", "tokens/s", "busy", "queue") else "left"
        )
    for row in status["components"]:
        tp = row.get("throughput") or {}
        table.add_row(
            row["name"],
            row["state"],
            str(row["pid"]),
            "yes" if row["pid"] and _alive(row["pid"]) else "no",
            str(row.get("restarts", 0)),
            _age(row.get("last_heartbeat_at")),
            format_rate(tp.get("samples_per_s")),
            format_rate(tp.get("tokens_per_s")),
            format_busy(row.get("busy")),
            format_queue(row),
            (f"{row['metrics_host']}:" if row.get("metrics_host", "127.0.0.1") != "127.0.0.1" else "")
            + str(row["metrics_port"]),
        )
    if not console.is_terminal:  # a pipe or file gets whole rows, not rows cut to 80 columns
        console = Console(highlight=False, soft_wrap=True, width=max(console.width, 160))
    console.print(table)
    for row in status["components"]:
        if row.get("last_error"):
            console.print(f"{row['name']}: last crash: {row['last_error']}", markup=False)
    from busctl.failures import failure_lines

    for line in failure_lines(status.get("failures") or {}):  # reward functions, environments, agents
        console.print(f"failures: {line}", markup=False, highlight=False)
    scale = status.get("scale") or {}
    if scale:
        console.print(
            f"last scale request: {scale.get('state')} {scale.get('targets', '')} {scale.get('error', '')}".rstrip()
        )
    if status.get("error"):
        console.print(f"[red]{status['error']}[/red]")
    return 0


def cmd_logs(ns: argparse.Namespace, console: Console) -> int:
    """Print a component's log; with ``-f`` keep printing what is appended (restarts append to
    the same file) until interrupted (Ctrl-C: exit 0)."""
    run_dir = _run_dir(ns.run_dir)
    path = run_dir / "logs" / f"{ns.component}.log"
    if not path.is_file():
        known = sorted(p.stem for p in (run_dir / "logs").glob("*.log"))
        print_error(f"no log for {ns.component!r} in {run_dir}; known: {known}")
        return 1
    with path.open() as f:
        sys.stdout.write(f.read())
        sys.stdout.flush()
        try:
            while ns.follow:
                line = f.readline()
                if line:
                    sys.stdout.write(line)
                    sys.stdout.flush()
                else:
                    time.sleep(0.2)
        except KeyboardInterrupt:
            pass
    return 0


def cmd_down(ns: argparse.Namespace, console: Console) -> int:
    status = read_status(_run_dir(ns.run_dir))
    pid = status["supervisor_pid"]
    if not supervisor_alive(status):
        console.print("run is not running")
        return 0
    if ns.finish:
        from busctl.finish import request_finish

        final = request_finish(_run_dir(ns.run_dir), read_status, supervisor_alive, ns.timeout)
        if isinstance(final, str):
            print_error(f"busctl down --finish: {final}")
            return 1
        console.print(f"finishing: the run ends after step {final} (checkpoint, final eval, exit 0)")
        return 0
    os.kill(pid, signal.SIGTERM)
    console.print(f"sent SIGTERM to busctl up (pid {pid}); it stops every component")
    return 0


def _parse_scale(args: list[str]) -> tuple[str | None, dict[str, int]]:
    """``[RUN_DIR] rewards=N producers=M servers=S`` -> (RUN_DIR or None, request).

    Raises:
        ValueError: an argument that is not ``rewards=N`` / ``producers=N`` / ``servers=N`` with an integer N,
            a key given twice, or none at all.
    """
    from busctl.scaling import SCALE_KEYS as SCALABLE

    run_dir, args = split_config_args(args)
    request: dict[str, int] = {}
    for arg in args:
        key, _, value = arg.partition("=")
        if key not in SCALABLE:
            raise ValueError(f"{arg!r}: expected {' or '.join(k + '=N' for k in SCALABLE)}")
        if key in request:
            raise ValueError(f"{key} given twice")
        try:
            request[key] = int(value)
        except ValueError:
            raise ValueError(f"{arg!r}: N must be a whole number") from None
    if not request:
        raise ValueError(f"nothing to scale: give {' and/or '.join(k + '=N' for k in SCALABLE)}")
    return run_dir, request


def cmd_scale(ns: argparse.Namespace, console: Console) -> int:
    from runfiles.durable import write_text_atomic
    from busctl.run_status import RunState
    from busctl.scaling import STOP_TIMEOUT_S, ScaleState, scale_targets
    from configs.schema import ConfigError, load_config

    try:
        run_arg, request = _parse_scale(ns.args)
        run_dir = _run_dir(run_arg)
        status = read_status(run_dir)
        cfg = load_config(run_dir / "config.yaml")
        scale_targets(cfg, request)
    except (ValueError, ConfigError) as err:  # ConfigError is a ValueError
        print_error(f"busctl scale: {err}")
        return 2
    if not supervisor_alive(status) or status.get("state") not in (RunState.STARTING, RunState.RUNNING):
        print_error(f"busctl scale: no running busctl up in {run_dir}")
        return 1
    rid = uuid.uuid4().hex
    write_text_atomic(run_dir / "scale.json", json.dumps({"id": rid, **request}))
    timeout_s = ns.timeout if ns.timeout is not None else cfg.bus.ready_timeout_s + STOP_TIMEOUT_S + 10
    if ns.timeout is None and "servers" in request:  # a new server loads the model and syncs its weights
        timeout_s += cfg.producers.server_start_timeout_s
    deadline = time.monotonic() + timeout_s
    announced = False
    while time.monotonic() < deadline:
        status = read_status(run_dir)
        scale = status.get("scale") or {}
        rejected = scale.get("rejected") or {}
        if rejected.get("id") == rid:
            print_error(f"busctl scale: refused: {rejected.get('error')}")
            return 1
        if scale.get("id") == rid:
            if scale.get("state") == ScaleState.FAILED:
                print_error(f"busctl scale: refused: {scale.get('error')}")
                return 1
            if scale.get("state") == ScaleState.DONE:
                console.print(
                    f"scaled {run_dir}: started {scale.get('added') or 'none'}, stopped "
                    f"{scale.get('removed') or 'none'}"
                )
                return 0
            if not announced:
                console.print(
                    f"applying: starting {scale.get('added') or 'none'}, stopping {scale.get('removed') or 'none'} ..."
                )
                announced = True
        if not supervisor_alive(status) or status.get("state") not in (RunState.STARTING, RunState.RUNNING):
            why = status.get("error") or status.get("outcome") or "no longer running"
            print_error(f"busctl scale: busctl up stopped before the request was done ({why})")
            return 1
        time.sleep(0.2)
    print_error(f"busctl scale: not done within {timeout_s:.0f} s; see `busctl status {run_dir}`")
    return 1


def add_commands(sub: argparse._SubParsersAction) -> dict:
    """Register ``status``, ``logs``, ``down`` and ``scale`` on ``sub``; returns ``{command: handler}``."""
    st = sub.add_parser(
        "status", help="show a run's step and components: state, pid, restarts, heartbeat, throughput, queue depth"
    )
    st.add_argument("run_dir", nargs="?", help="run directory (default: the default config's run_dir)")
    lg = sub.add_parser("logs", help="print a component's log")
    lg.add_argument("run_dir", nargs="?", help="run directory (default: the default config's run_dir)")
    lg.add_argument("component", help="e.g. trainer, producer-0, rewards-1")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    dn = sub.add_parser("down", help="stop a running job")
    dn.add_argument("run_dir", nargs="?", help="run directory (default: the default config's run_dir)")
    dn.add_argument(
        "--finish",
        action="store_true",
        help="end cleanly as if trainer.max_steps were the next step not yet issued: train the steps issued, "
        "then the final checkpoint, eval round and exit 0",
    )
    dn.add_argument("--timeout", type=float, default=60.0, help="--finish: seconds to wait for the answer")
    sc = sub.add_parser(
        "scale", help="change the number of reward workers / producers / each producer's servers of a running job"
    )
    sc.add_argument("args", nargs="+", metavar="ARG", help="[RUN_DIR] rewards=N, producers=N and/or servers=N")
    sc.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds to wait for the new set to be ready (default: bus.ready_timeout_s + 30)",
    )
    return {"status": cmd_status, "logs": cmd_logs, "down": cmd_down, "scale": cmd_scale}
