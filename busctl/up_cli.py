"""``busctl up``: load and check the config (or a stopped run's, ``--resume``), plan the devices,
and run the job under a :class:`busctl.supervisor.Supervisor` until it is done, fails or is
interrupted (exit codes: :data:`busctl.cli.HELP`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from busctl.launchers import LAUNCHERS
from busctl.run_cli import NoRun, read_status, split_config_args, supervisor_alive
from busctl.stderr import print_error, print_warning

if TYPE_CHECKING:  # the config, run-directory and supervisor modules are imported where used (busctl --help stays fast)
    from busctl.run_dir import Occupant
    from busctl.supervisor import Supervisor
    from configs.schema import RunConfig


def resume_config(target: str | None, overrides: list[str]) -> RunConfig:
    """The config of ``busctl up --resume [TARGET] [overrides]``: ``RUN_DIR/config.yaml`` with the overrides, a fresh
    broadcast port and ``run_dir`` resolved. ``target``: a run directory, or a config file whose ``run_dir`` is the
    run; None: the default config's.

    Raises:
        ConfigError: no such directory or file, no ``config.yaml`` in it, a ``run_dir`` override, or an invalid
            override.
    """
    from configs.schema import ConfigError, load_config

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
        raise ConfigError(
            f"nothing to resume in {run_dir}: no {saved} (a run writes it at start; start one with `busctl up`)"
        )
    if any(o.partition("=")[0].strip() == "run_dir" for o in overrides):
        raise ConfigError("run_dir cannot be overridden with --resume: the run continues in its own directory")
    cfg = load_config(saved, ["broadcast.port=0", *overrides])
    cfg.run_dir = str(run_dir.resolve())
    return cfg


def _up_commands(ns: argparse.Namespace, run_dir: Path) -> tuple[str, str]:
    """The ``busctl up`` command line as given, and the same with ``run_dir=`` a free sibling (``RUN_DIR-2``, ...):
    the ways on an occupied run directory's refusal shows."""
    given = ["busctl", "up", *(["--launcher", ns.launcher] if ns.launcher else []), *ns.args]
    n = 2
    while Path(f"{run_dir}-{n}").exists():
        n += 1
    elsewhere = [a for a in given if not a.startswith("run_dir=")] + [f"run_dir={run_dir}-{n}"]
    return shlex.join(given), shlex.join(elsewhere)


def _check_run_dir(cfg: RunConfig, ns: argparse.Namespace) -> tuple[int, str, Occupant | None]:
    """Whether a fresh run may start in ``cfg.run_dir``: ``(exit code, message, occupant)``, 0 when missing, empty
    or ``--overwrite`` of a run's outputs; 1 when its ``busctl up`` still runs; 2 (the refusal) otherwise."""
    from busctl.run_dir import inspect_run_dir, refusal

    run_dir = Path(cfg.run_dir)
    try:
        previous = read_status(run_dir)
    except (NoRun, ValueError):
        previous = None
    if previous is not None and supervisor_alive(previous):
        return (
            1,
            (
                f"a run is already going in {run_dir} (busctl up pid {previous['supervisor_pid']}); "
                f"stop it first: busctl down {run_dir}"
            ),
            None,
        )
    if ns.resume:
        return 0, "", None
    try:
        occupant = inspect_run_dir(run_dir)
    except ValueError as err:
        return 2, str(err), None
    if occupant is None or (ns.overwrite and occupant.is_run):
        return 0, "", occupant
    return 2, refusal(occupant, *_up_commands(ns, run_dir)), occupant


def cmd_up(ns: argparse.Namespace, console: Console) -> int:
    """``busctl up``: the exit code (:data:`busctl.cli.HELP`). The config, device plan, key files, model paths,
    names and dataset rows (:mod:`busctl.preflight`) and run directory are checked before anything is spawned or
    written;
    ``--dry-run`` runs the same checks, prints the resolved config and plan and stops."""
    from bus.auth import check_keys
    from configs.api_keys import check_endpoint_keys
    from telemetry.tls import tls_from_config
    from busctl.cpu_bf16 import cpu_bf16_warning
    from busctl.launchers import make_launcher
    from busctl.metrics_targets import supervisor_metrics_host
    from busctl.components.placement import apply_placement
    from busctl.preflight import check_data, check_names
    from busctl.run_dir import overwrite
    from busctl.startup import process_started_at
    from busctl.supervisor import Supervisor  # zmq/rich only; torch stays out until needed
    from configs.model_path import resolve_run_model_paths
    from configs.schema import ConfigError, dump_config, load_config

    if ns.resume and ns.overwrite:
        print_error("busctl up: --resume continues a run and --overwrite deletes one: give one of them")
        return 2
    config_path, overrides = split_config_args(ns.args)
    try:
        cfg = resume_config(config_path, overrides) if ns.resume else load_config(config_path, overrides)
        cfg.supervisor.launcher = ns.launcher or cfg.supervisor.launcher
        cfg.supervisor.ray_address = ns.address or cfg.supervisor.ray_address
        placement = apply_placement(cfg)  # trainer.device and producers.dtype resolved in cfg
        check_keys(cfg.bus)  # the CurveZMQ key files, read here at launch (the config imports no bus)
        check_endpoint_keys(cfg.producers.endpoint_host, cfg.producers.endpoint_api_keys_file)  # beyond loopback
        if cfg.supervisor.launcher == "local" and (tls := tls_from_config(cfg.bus)) is not None:
            tls.server_files(supervisor_metrics_host(cfg))  # metrics TLS: a server certificate naming this host
        checked = cfg.model_copy(deep=True) if ns.dry_run else cfg  # --dry-run prints the paths as given
        resolve_run_model_paths(checked)  # a hub id becomes its HF-cache snapshot: every component loads the same files
        check_names(cfg)
        data_notes = check_data(cfg)  # every row of the dataset files, within a time budget
        if cfg.eval.only:  # no trainer would start and the run would never end
            raise ValueError(
                "eval.only=true is busctl eval's mode, not a training run: "
                f"run `busctl eval {config_path or ''} [overrides]` instead".replace("  ", " ")
            )
    except (ValueError, FileNotFoundError) as err:  # a ConfigError, a key file, a model path, a name
        print_error(str(err))
        return 2
    for note in data_notes:
        print_warning(note)
    code, why, occupant = _check_run_dir(cfg, ns)
    if ns.dry_run:
        print(dump_config(cfg) + placement.describe())
        if code:
            print_warning(f"busctl up would refuse this run: {why}")
        elif occupant is not None:
            print_warning(
                f"busctl up --overwrite would delete the previous run in {occupant.run_dir}: {occupant.what()}"
            )
        return 0
    if code:
        print_error(why)
        return code
    slow_bf16 = cpu_bf16_warning(cfg.trainer.dtype, cfg.trainer.device)  # measured only for a bf16 CPU trainer
    if slow_bf16:
        print_warning(slow_bf16)
    try:
        launcher = make_launcher(cfg)  # slurm: the allocation's nodes; ray: connects (not needed by --dry-run)
    except ConfigError as err:
        print_error(str(err))
        return 2
    if occupant is not None:  # --overwrite of a run's directory: said entry by entry, then deleted
        overwrite(occupant, lambda line: console.print(line, markup=False))
    if placement.visible:  # a GPU host: say which component got which devices
        console.print(placement.describe(), markup=False, highlight=False)
    launcher.configure(cfg)  # slurm, ray: tcp bound to each node's address, per-run CurveZMQ keys
    sup = Supervisor(
        cfg,
        console,
        resume=ns.resume,
        launched_at=getattr(ns, "launched_at", None) or process_started_at(os.getpid()),  # rlbus.run: its call
        placement=placement,
        launcher=launcher,
    )

    def on_signal(signum: int, _frame: object) -> None:
        sup.stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return supervise(sup, console)


def supervise(sup: "Supervisor", console: Console) -> int:
    """Run ``sup`` through prepare, start, watch and (always) shutdown, printing to ``console`` (a live display on a
    terminal); ``sup.stop`` set means interrupted. Records the outcome and error in ``sup`` for ``status.json``.

    Returns:
        The exit code of ``busctl up``: 0 done, 1 failed, 130 interrupted.
    """
    from contextlib import nullcontext

    from busctl.live import LiveDisplay
    from busctl.run_status import RunOutcome
    from busctl.supervisor import RunFailed
    from trackers.launch import TrackerProcess

    started = time.monotonic()
    failed = False
    trackers = None
    try:
        sup.prepare()
        console.print(f"run directory: {sup.run_dir}" + (" (resumed)" if sup.resume else ""))
        trackers = TrackerProcess.start(sup.cfg.report.trackers, sup.run_dir, console)  # report.trackers; None: none
        with LiveDisplay(console, lambda: sup.snapshot) if console.is_terminal else nullcontext():
            sup.start()
            doing = "evaluating" if sup.cfg.eval.only else "training"
            console.print(f"all {len(sup.table)} components ready in {time.monotonic() - started:.1f} s; {doing}")
            sup.watch()
    except RunFailed as err:
        if not sup.stop.is_set():
            console.print(Text(f"run failed: {err}", style="red"))  # the run's own output; a message is never markup
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
        if trackers is not None:  # after the components: the files are complete, the trackers drain them
            trackers.stop(console)
    if failed:
        return 1
    if not sup.run_done:
        console.print("interrupted; every component stopped")
        return 130
    restarts = sum(s.restarts for s in sup.table)
    console.print(
        f"[green]done[/green] in {time.monotonic() - started:.0f} s ({restarts} restarts); "
        f"metrics in {sup.run_dir / 'metrics.jsonl'}"
    )
    return 0


def add_up(sub: argparse._SubParsersAction) -> dict:
    """Register ``up`` on ``sub``; returns ``{"up": handler}``."""
    up = sub.add_parser(
        "up",
        help="run a job, or continue a stopped one (--resume)",
        description="Run a job: busctl up [CONFIG] [key.sub=value ...]. Continue a stopped one in its run "
        "directory: busctl up --resume [RUN_DIR | CONFIG] [key.sub=value ...].",
    )
    up.add_argument(
        "args",
        nargs="*",
        help="[CONFIG.yaml] [key.sub=value ...]; with --resume: [RUN_DIR | CONFIG.yaml] [key.sub=value ...]",
    )
    up.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check busctl up runs before it starts anything (config, devices, keys, model paths, "
        "task/reward/environment names, the rows of the dataset files), print the resolved config and the device "
        "plan, and exit",
    )
    up.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default=None,
        help="start components as local processes, as srun steps inside a Slurm allocation, or through Ray actors "
        "on the nodes of a Ray cluster (default: supervisor.launcher)",
    )
    up.add_argument(
        "--address", default=None, help="with --launcher ray: the Ray cluster (default: supervisor.ray_address, auto)"
    )
    up.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in RUN_DIR (default: the default config's run_dir) from its config.yaml, "
        "checkpoints, ledgers and packer spool; nothing is cleared, logs are appended",
    )
    up.add_argument(
        "--overwrite",
        action="store_true",
        help="when run_dir holds a previous run, delete it (each entry is named first) and start over; "
        "without it busctl up refuses an occupied run_dir (exit 2)",
    )
    return {"up": cmd_up}
