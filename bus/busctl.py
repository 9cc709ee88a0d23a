"""``busctl``: the command line of rlbus.

    busctl up [CONFIG] [key.sub=value ...] [--dry-run]   run a job (default: configs/reverse_text.yaml)
    busctl status RUN_DIR                               components of a run: state, pid, metrics port
    busctl logs RUN_DIR COMPONENT [-f]                  a component's log
    busctl down RUN_DIR                                 stop a running ``busctl up`` (SIGTERM; it drains)
    busctl keys DIR [--clients N]                       make CurveZMQ keys for an authenticated tcp:// bus

Exit codes of ``up``: 0 when the trainer reached ``max_steps``; 1 when a component failed;
2 for a bad config; 130 when interrupted (SIGINT/SIGTERM), after every process has stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from rich.console import Console

from configs.schema import ConfigError, dump_config, load_config


def _split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG] [overrides...]``: the first argument is a config path unless it has ``=``."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return None, args


def cmd_up(ns: argparse.Namespace, console: Console) -> int:
    from bus.supervisor import RunFailed, Supervisor  # zmq/rich only; torch stays out until needed

    config_path, overrides = _split_config_args(ns.args)
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as err:
        console.print(f"[red]{err}[/red]")
        return 2
    if ns.dry_run:
        print(dump_config(cfg), end="")
        return 0
    sup = Supervisor(cfg, console)
    interrupted = []

    def on_signal(signum: int, _frame: object) -> None:
        interrupted.append(signum)
        sup.stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    try:
        sup.prepare()
        console.print(f"run directory: {sup.run_dir}")
        sup.start()
        console.print(f"all {len(sup.table)} components ready in {time.monotonic() - started:.1f} s; training")
        sup.watch()
    except RunFailed as err:
        if not interrupted:
            console.print(f"[red]run failed: {err}[/red]")
            return 1
    finally:
        console.print("stopping components ...")
        sup.shutdown()
    if interrupted:
        console.print("interrupted; every component stopped")
        return 130
    console.print(f"[green]done[/green] in {time.monotonic() - started:.0f} s; metrics in {sup.run_dir / 'metrics.jsonl'}")
    return 0


def _status(run_dir: Path) -> dict:
    path = run_dir / "status.json"
    if not path.is_file():
        raise SystemExit(f"busctl: no run at {run_dir} (missing status.json)")
    return json.loads(path.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def cmd_status(ns: argparse.Namespace, console: Console) -> int:
    from rich.table import Table

    status = _status(Path(ns.run_dir))
    sup_alive = _alive(status["supervisor_pid"])
    table = Table(title=f"{status['run_dir']} (supervisor pid {status['supervisor_pid']}, {'running' if sup_alive else 'stopped'})")
    for col in ("component", "state", "pid", "alive", "metrics port"):
        table.add_column(col)
    for row in status["components"]:
        table.add_row(row["name"], row["state"], str(row["pid"]), "yes" if row["pid"] and _alive(row["pid"]) else "no", str(row["metrics_port"]))
    console.print(table)
    return 0


def cmd_logs(ns: argparse.Namespace, console: Console) -> int:
    path = Path(ns.run_dir) / "logs" / f"{ns.component}.log"
    if not path.is_file():
        known = sorted(p.stem for p in (Path(ns.run_dir) / "logs").glob("*.log"))
        console.print(f"[red]no log for {ns.component!r}; known: {known}[/red]")
        return 1
    with path.open() as f:
        sys.stdout.write(f.read())
        while ns.follow:
            line = f.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            else:
                time.sleep(0.2)
    return 0


def cmd_down(ns: argparse.Namespace, console: Console) -> int:
    pid = _status(Path(ns.run_dir))["supervisor_pid"]
    if not _alive(pid):
        console.print("run is not running")
        return 0
    os.kill(pid, signal.SIGTERM)
    console.print(f"sent SIGTERM to busctl up (pid {pid}); it stops every component")
    return 0


def cmd_keys(ns: argparse.Namespace, console: Console) -> int:
    from bus.auth import CLIENTS_DIR, create_keys  # zmq only

    keys_dir = Path(ns.dir).resolve()
    try:
        created = create_keys(keys_dir, ns.clients)
    except ValueError as err:
        console.print(f"[red]{err}[/red]")
        return 1
    print(f"CurveZMQ keys in {keys_dir} (mode 0700; *.key_secret files are secret):")
    for path in created:
        print(f"  {path}")
    print(f"allow-list: {keys_dir / CLIENTS_DIR}/*.key (every public key there may connect)")
    print(f"use:        busctl up CONFIG bus.transport=tcp bus.curve_keys_dir={keys_dir}")
    print("multi-host: copy the whole directory to the same path on every host, keeping it private, e.g.")
    print(f"            rsync -a {keys_dir}/ HOST:{keys_dir}/")
    print("            a host with its own client keypair sets bus.curve_client=NAME; to revoke one,")
    print(f"            delete {CLIENTS_DIR}/NAME.key on every host and restart the processes that bind")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="busctl", description="Run and inspect rlbus pipelines.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="run a job")
    up.add_argument("args", nargs="*", help="[CONFIG.yaml] [key.sub=value ...]")
    up.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    st = sub.add_parser("status", help="show a run's components")
    st.add_argument("run_dir")
    lg = sub.add_parser("logs", help="print a component's log")
    lg.add_argument("run_dir")
    lg.add_argument("component")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines")
    dn = sub.add_parser("down", help="stop a running job")
    dn.add_argument("run_dir")
    ks = sub.add_parser("keys", help="create CurveZMQ keys (server + client keypairs, allow-list)")
    ks.add_argument("dir", help="new key directory (must not hold keys yet)")
    ks.add_argument("--clients", type=int, default=1,
                    help="client keypairs: 'components' (shared by every process), then client-1 ... (default 1)")
    ns = parser.parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)  # never break paths or messages mid-line
    handler = {"up": cmd_up, "status": cmd_status, "logs": cmd_logs, "down": cmd_down, "keys": cmd_keys}[ns.command]
    return handler(ns, console)


if __name__ == "__main__":
    raise SystemExit(main())
