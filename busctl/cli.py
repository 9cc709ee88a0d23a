"""``busctl``: the command line of rlbus.

    busctl up [CONFIG] [key.sub=value ...] [--dry-run]    run a job (default: configs/reverse_text.yaml)
    busctl up --resume [RUN_DIR | CONFIG] [key=value ...] continue a stopped run in its run directory
    busctl status [RUN_DIR]                              components: state, pid, restarts, heartbeat, throughput, queues
    busctl logs [RUN_DIR] COMPONENT [-f]                 a component's log (-f: follow)
    busctl scale [RUN_DIR] rewards=N producers=M         resize a running job (either or both)
    busctl down [RUN_DIR]                                stop a running ``busctl up`` (SIGTERM; it drains)
    busctl keys DIR [--clients N]                        make CurveZMQ keys for an authenticated tcp:// bus
    busctl sbatch [CONFIG] [key=value ...] [-o FILE]     a Slurm batch script running the job (busctl up --launcher slurm)
    busctl report RUN_DIR [--out DIR]                    plots (PNG) and a text summary of a run

RUN_DIR defaults to the default config's ``run_dir`` (``runs/reverse_text``).

``up`` first plans the devices (:mod:`busctl.placement`): each component gets its own
``CUDA_VISIBLE_DEVICES`` (``""``: no GPU), ``trainer.device``, ``producers.dtype`` and
``broadcast.backend`` are resolved (``auto`` -> concrete) in the run's ``config.yaml``, and a plan that does not fit the visible GPUs
is a bad config naming the keys and the devices seen. ``--dry-run`` prints the resolved config and
then the plan (``#`` lines: the output stays YAML).

``up --launcher slurm`` (or ``supervisor.launcher: slurm``) runs inside a Slurm allocation, each
component an ``srun`` step on its node (:mod:`busctl.launchers.slurm`); ``up --launcher ray
[--address ADDR]`` on a running Ray cluster, each component started by a Ray actor on its node
(:mod:`busctl.launchers.ray`).

``up`` heals: a component that exits or stops sending heartbeats before the run is done is
restarted with exponential backoff (``supervisor.*`` in the config); the packer continues from
its spool (``RUN_DIR/packer/``).

``up --resume runs/reverse_text [overrides]`` continues a run that stopped (interrupted, failed,
or killed): it keeps the run directory (checkpoints/, metrics.jsonl, trained_samples.jsonl,
ledgers; logs are appended), reuses its ``config.yaml`` with the overrides applied on top and a
new broadcast port, and starts every component with ``RLBUS_RESUME=1`` (the trainer continues
from its last checkpoint, the packer from its spool or, without one, numbers steps from that
checkpoint, the prompt source re-issues every prompt without an outcome in its ledger). Given a config file instead of a directory, its ``run_dir`` is resumed.

``scale`` talks to the ``busctl up`` of RUN_DIR (through ``RUN_DIR/scale.json``) and waits until
the new set of components is ready: new replicas get the next indices (new producers join late,
``RLBUS_LATE_JOIN=1``; at most ``producers.max_replicas``), removed ones are the highest indices,
stopped gracefully (SIGTERM, SIGKILL after 20 s); never fewer than one of each.

Exit codes: ``up``: 0 when the trainer reached ``max_steps``; 1 when a component failed (and
could not be restarted); 2 for a bad config (or a device plan that does not fit, or a ``model.path``
neither a directory nor in the local HF cache); 130 when interrupted (SIGINT/SIGTERM), after every
process has stopped. ``scale``: 0 done; 1 no running job, refused by it, or not done in time;
2 bad arguments (also more producers than ``producers.max_replicas`` or than the GPUs hold). Others: 0 ok, 1 failure,
2 bad usage.
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
from typing import TYPE_CHECKING

from rich.console import Console

from busctl.cluster_cli import add_commands
from busctl.launchers import LAUNCHERS, make_launcher
from busctl.placement import apply_placement
from busctl.report import cmd_report
from busctl.run_status import RunOutcome, RunState
from configs.model_path import resolve_run_model_paths
from configs.schema import ConfigError, RunConfig, dump_config, load_config

if TYPE_CHECKING:
    from busctl.supervisor import Supervisor


def _split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [overrides...]``: the first argument is a config path unless it has ``=``."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def resume_config(target: str | None, overrides: list[str]) -> RunConfig:
    """The config of ``busctl up --resume [TARGET] [overrides]``.

    Args:
        target: a run directory, or a config file whose ``run_dir`` is the run; None: the
            default config's run directory.
        overrides: dotted overrides applied on top of the run's saved ``config.yaml``
            (``run_dir`` may not be one: the run continues where it is).

    Returns:
        ``RUN_DIR/config.yaml`` with the overrides, a fresh broadcast port (0: picked at start),
        and ``run_dir`` set to the directory found.

    Raises:
        ConfigError: no such directory or file, no ``config.yaml`` in the run directory, a
            ``run_dir`` override, or an invalid override.
    """
    if target is None:
        run_dir = Path(load_config(None).run_dir)
    elif Path(target).is_dir():
        run_dir = Path(target)
    elif Path(target).is_file():
        run_dir = Path(load_config(target).run_dir)
    else:
        raise ConfigError(f"--resume {target}: no such run directory or config file")
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        raise ConfigError(f"nothing to resume in {run_dir}: no {saved} (a run writes it at start; start one with `busctl up`)")
    if any(o.partition("=")[0].strip() == "run_dir" for o in overrides):
        raise ConfigError("run_dir cannot be overridden with --resume: the run continues in its own directory")
    cfg = load_config(saved, ["broadcast.port=0", *overrides])
    cfg.run_dir = str(run_dir.resolve())
    return cfg


def cmd_up(ns: argparse.Namespace, console: Console) -> int:
    from bus.auth import check_keys
    from busctl.cpu_bf16 import cpu_bf16_warning
    from busctl.startup import process_started_at
    from busctl.supervisor import Supervisor  # zmq/rich only; torch stays out until needed

    config_path, overrides = _split_config_args(ns.args)
    try:
        cfg = resume_config(config_path, overrides) if ns.resume else load_config(config_path, overrides)
        cfg.supervisor.launcher = ns.launcher or cfg.supervisor.launcher
        cfg.supervisor.ray_address = ns.address or cfg.supervisor.ray_address
        placement = apply_placement(cfg)  # trainer.device and producers.dtype resolved in cfg
        check_keys(cfg.bus)  # the CurveZMQ key files, read here at launch (the config imports no bus)
    except ValueError as err:  # a ConfigError, or a key file missing or unreadable
        console.print(f"[red]{err}[/red]")
        return 2
    if ns.dry_run:
        print(dump_config(cfg) + placement.describe())
        return 0
    slow_bf16 = cpu_bf16_warning(cfg.trainer.dtype, cfg.trainer.device)  # measured only for a bf16 CPU trainer
    if slow_bf16:
        console.print(f"[yellow]warning: {slow_bf16}[/yellow]", highlight=False)
    try:
        launcher = make_launcher(cfg)  # slurm: the allocation's nodes; ray: connects (not needed by --dry-run)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        return 2
    run_dir = Path(cfg.run_dir)
    try:
        previous = _status(run_dir)
    except (NoRun, ValueError):
        previous = None
    if previous is not None and _supervisor_alive(previous):
        console.print(f"[red]a run is already going in {run_dir} (busctl up pid {previous['supervisor_pid']}); "
                      f"stop it first: busctl down {run_dir}[/red]")
        return 1
    try:  # a hub id becomes its local HF-cache snapshot directory: every component loads the same files
        resolve_run_model_paths(cfg)
    except (FileNotFoundError, ValueError) as err:
        console.print(f"[red]{err}[/red]")
        return 2
    if placement.visible:  # a GPU host: say which component got which devices
        console.print(placement.describe(), markup=False, highlight=False)
    launcher.configure(cfg)  # slurm, ray: tcp bound to each node's address, per-run CurveZMQ keys
    sup = Supervisor(cfg, console, resume=ns.resume, launched_at=process_started_at(os.getpid()), placement=placement,
                     launcher=launcher)

    def on_signal(signum: int, _frame: object) -> None:
        sup.stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return supervise(sup, console)


def supervise(sup: "Supervisor", console: Console) -> int:
    """Run ``sup`` through prepare, start, watch and (always) shutdown, printing to ``console``
    (on a terminal, below the lines, a live display of :mod:`busctl.live` during start and watch);
    ``sup.stop`` set (by a signal handler, or a test) means interrupted. Records the outcome
    (``done``, ``failed``, ``interrupted``) and error in ``sup`` for ``status.json``.

    Returns:
        The exit code of ``busctl up``: 0 done, 1 failed, 130 interrupted.
    """
    from contextlib import nullcontext

    from busctl.live import LiveDisplay
    from busctl.supervisor import RunFailed

    started = time.monotonic()
    failed = False
    try:
        sup.prepare()
        console.print(f"run directory: {sup.run_dir}" + (" (resumed)" if sup.resume else ""))
        with LiveDisplay(console, lambda: sup.snapshot) if console.is_terminal else nullcontext():
            sup.start()
            console.print(f"all {len(sup.table)} components ready in {time.monotonic() - started:.1f} s; training")
            sup.watch()
    except RunFailed as err:
        if not sup.stop.is_set():
            console.print(f"[red]run failed: {err}[/red]")
            sup.error, failed = str(err), True
    finally:
        if sup.run_done and not failed:
            sup.outcome = RunOutcome.DONE
        elif sup.stop.is_set() and not failed:
            sup.outcome = RunOutcome.INTERRUPTED
        else:  # RunFailed, or an unexpected error on its way up
            sup.outcome = RunOutcome.FAILED
        console.print("stopping components ...")
        sup.shutdown()
    if failed:
        return 1
    if not sup.run_done:
        console.print("interrupted; every component stopped")
        return 130
    restarts = sum(s.restarts for s in sup.table)
    console.print(f"[green]done[/green] in {time.monotonic() - started:.0f} s ({restarts} restarts); "
                  f"metrics in {sup.run_dir / 'metrics.jsonl'}")
    return 0


def _run_dir(arg: str | None) -> Path:
    """The run directory a command names, or the default config's ``run_dir`` when it names none."""
    return Path(arg) if arg else Path(load_config(None).run_dir)


class NoRun(Exception):
    """A command needs a run directory with a ``status.json`` and it has none."""


def _status(run_dir: Path) -> dict:
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


def _supervisor_alive(status: dict) -> bool:
    """Is the ``busctl up`` that wrote ``status`` still running (same pid, same process start time)?"""
    from busctl.component_table import process_start_ticks

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
    status = _status(run_dir)
    sup_alive = _supervisor_alive(status)
    state = status.get("state", "?") if sup_alive else "not running"
    outcome = f", outcome {status['outcome']}" if status.get("outcome") else ""
    console.print(f"{status['run_dir']}: busctl up pid {status['supervisor_pid']} {state}{outcome}"
                  + (f", supervisor metrics :{status['metrics_port']}" if status.get("metrics_port") else ""))
    console.print(trainer_text(status))
    table = Table()
    for col in ("component", "state", "pid", "alive", "restarts", "heartbeat", "samples/s", "tokens/s", "busy", "queue",
                "metrics port"):
        table.add_column(col, no_wrap=True, justify="right" if col in ("samples/s", "tokens/s", "busy", "queue") else "left")
    for row in status["components"]:
        tp = row.get("throughput") or {}
        table.add_row(row["name"], row["state"], str(row["pid"]), "yes" if row["pid"] and _alive(row["pid"]) else "no",
                      str(row.get("restarts", 0)), _age(row.get("last_heartbeat_at")), format_rate(tp.get("samples_per_s")),
                      format_rate(tp.get("tokens_per_s")), format_busy(row.get("busy")), format_queue(row),
                      (f"{row['metrics_host']}:" if row.get("metrics_host", "127.0.0.1") != "127.0.0.1" else "") + str(row["metrics_port"]))
    if not console.is_terminal:  # a pipe or file gets whole rows, not rows cut to 80 columns
        console = Console(highlight=False, soft_wrap=True, width=max(console.width, 160))
    console.print(table)
    for row in status["components"]:
        if row.get("last_error"):
            console.print(f"{row['name']}: last crash: {row['last_error']}")
    scale = status.get("scale") or {}
    if scale:
        console.print(f"last scale request: {scale.get('state')} {scale.get('targets', '')} {scale.get('error', '')}".rstrip())
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
        console.print(f"[red]no log for {ns.component!r} in {run_dir}; known: {known}[/red]")
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
    status = _status(_run_dir(ns.run_dir))
    pid = status["supervisor_pid"]
    if not _supervisor_alive(status):
        console.print("run is not running")
        return 0
    os.kill(pid, signal.SIGTERM)
    console.print(f"sent SIGTERM to busctl up (pid {pid}); it stops every component")
    return 0


def _parse_scale(args: list[str]) -> tuple[str | None, dict[str, int]]:
    """``[RUN_DIR] rewards=N producers=M`` -> (RUN_DIR or None, request).

    Raises:
        ValueError: an argument that is not ``rewards=N`` / ``producers=N`` with an integer N,
            a key given twice, or none at all.
    """
    from busctl.scaling import SCALABLE

    run_dir, args = _split_config_args(args)
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
    from busctl.run_status import write_text_atomic
    from busctl.scaling import STOP_TIMEOUT_S, ScaleState, scale_targets

    try:
        run_arg, request = _parse_scale(ns.args)
        run_dir = _run_dir(run_arg)
        status = _status(run_dir)
        cfg = load_config(run_dir / "config.yaml")
        scale_targets(cfg, request)
    except (ValueError, ConfigError) as err:  # ConfigError is a ValueError
        console.print(f"[red]busctl scale: {err}[/red]")
        return 2
    if not _supervisor_alive(status) or status.get("state") not in (RunState.STARTING, RunState.RUNNING):
        console.print(f"[red]busctl scale: no running busctl up in {run_dir}[/red]")
        return 1
    rid = uuid.uuid4().hex
    write_text_atomic(run_dir / "scale.json", json.dumps({"id": rid, **request}))
    timeout_s = ns.timeout if ns.timeout is not None else cfg.bus.ready_timeout_s + STOP_TIMEOUT_S + 10
    deadline = time.monotonic() + timeout_s
    announced = False
    while time.monotonic() < deadline:
        status = _status(run_dir)
        scale = status.get("scale") or {}
        rejected = scale.get("rejected") or {}
        if rejected.get("id") == rid:
            console.print(f"[red]busctl scale: refused: {rejected.get('error')}[/red]")
            return 1
        if scale.get("id") == rid:
            if scale.get("state") == ScaleState.FAILED:
                console.print(f"[red]busctl scale: refused: {scale.get('error')}[/red]")
                return 1
            if scale.get("state") == ScaleState.DONE:
                console.print(f"scaled {run_dir}: started {scale.get('added') or 'none'}, stopped {scale.get('removed') or 'none'}")
                return 0
            if not announced:
                console.print(f"applying: starting {scale.get('added') or 'none'}, stopping {scale.get('removed') or 'none'} ...")
                announced = True
        if not _supervisor_alive(status) or status.get("state") not in (RunState.STARTING, RunState.RUNNING):
            why = status.get("error") or status.get("outcome") or "no longer running"
            console.print(f"[red]busctl scale: busctl up stopped before the request was done ({why})[/red]")
            return 1
        time.sleep(0.2)
    console.print(f"[red]busctl scale: not done within {timeout_s:.0f} s; see `busctl status {run_dir}`[/red]")
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="busctl", description="Run and inspect rlbus pipelines.",
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run a job, or continue a stopped one (--resume)",
                        description="Run a job: busctl up [CONFIG] [key.sub=value ...]. Continue a stopped one in its run "
                        "directory: busctl up --resume [RUN_DIR | CONFIG] [key.sub=value ...].")
    up.add_argument("args", nargs="*", help="[CONFIG.yaml] [key.sub=value ...]; with --resume: [RUN_DIR | CONFIG.yaml] [key.sub=value ...]")
    up.add_argument("--dry-run", action="store_true", help="print the resolved config and the device plan, and exit")
    up.add_argument("--launcher", choices=LAUNCHERS, default=None,
                    help="start components as local processes, as srun steps inside a Slurm allocation, or through Ray actors "
                    "on the nodes of a Ray cluster (default: supervisor.launcher)")
    up.add_argument("--address", default=None, help="with --launcher ray: the Ray cluster (default: supervisor.ray_address, auto)")
    up.add_argument("--resume", action="store_true",
                    help="continue the run in RUN_DIR (default: the default config's run_dir) from its config.yaml, "
                    "checkpoints, ledgers and packer spool; nothing is cleared, logs are appended")
    st = sub.add_parser("status", help="show a run's step and components: state, pid, restarts, heartbeat, throughput, queue depth")
    st.add_argument("run_dir", nargs="?", help="run directory (default: the default config's run_dir)")
    lg = sub.add_parser("logs", help="print a component's log")
    lg.add_argument("run_dir", nargs="?", help="run directory (default: the default config's run_dir)")
    lg.add_argument("component", help="e.g. trainer, producer-0, rewards-1")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    dn = sub.add_parser("down", help="stop a running job")
    dn.add_argument("run_dir", nargs="?", help="run directory (default: the default config's run_dir)")
    sc = sub.add_parser("scale", help="change the number of reward workers / producers of a running job")
    sc.add_argument("args", nargs="+", metavar="ARG", help="[RUN_DIR] rewards=N and/or producers=N")
    sc.add_argument("--timeout", type=float, default=None,
                    help="seconds to wait for the new set to be ready (default: bus.ready_timeout_s + 30)")
    cluster_commands = add_commands(sub)
    rp = sub.add_parser("report", help="plot a run's metrics (PNG) and print a short summary")
    rp.add_argument("run_dir", help="run directory (holds metrics.jsonl)")
    rp.add_argument("--out", default=None, help="where to write the plots and summary.txt (default: RUN_DIR/report)")
    ns = parser.parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)  # never break paths or messages mid-line
    handler = {"up": cmd_up, "status": cmd_status, "logs": cmd_logs, "down": cmd_down, "scale": cmd_scale, "report": cmd_report,
               **cluster_commands}[ns.command]
    try:
        return handler(ns, console)
    except NoRun as err:
        console.print(f"[red]busctl {ns.command}: {err}[/red]")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
