"""The multi-host commands of ``busctl``: ``keys`` (CurveZMQ keys) and ``sbatch`` (a Slurm batch script).

:func:`add_commands` registers both subcommands on the ``busctl`` parser and returns their
handlers, which take ``(namespace, console)`` and return the exit code (0 ok, 1 failure, 2 bad
config), like the others in :mod:`busctl.cli`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from rich.console import Console

from configs.schema import ConfigError, load_config


def cmd_keys(ns: argparse.Namespace, console: Console) -> int:
    """``busctl keys DIR [--clients N]``: create a CurveZMQ key directory and say how to use it."""
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


def cmd_sbatch(ns: argparse.Namespace, console: Console) -> int:
    """``busctl sbatch [CONFIG] [key=value ...] [-o FILE]``: write the job's batch script
    (:func:`busctl.launchers.sbatch.sbatch_script`) to FILE, or print it."""
    from bus.auth import check_keys  # zmq only
    from busctl.launchers.sbatch import sbatch_script

    config_path, overrides = (ns.args[0], ns.args[1:]) if ns.args and "=" not in ns.args[0] else (None, ns.args)
    try:
        cfg = load_config(config_path, overrides)
        check_keys(cfg.bus)  # a bus.curve_keys_dir given must hold keys (the config does not read them)
        script = sbatch_script(cfg, str(Path(config_path).resolve()) if config_path else None, overrides)
    except (ConfigError, ValueError) as err:
        console.print(f"[red]{err}[/red]")
        return 2
    if ns.output:
        Path(ns.output).write_text(script)
        console.print(f"wrote {ns.output}; submit it with: sbatch {ns.output}")
    else:
        print(script, end="")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> dict[str, Callable[[argparse.Namespace, Console], int]]:
    """Register ``keys`` and ``sbatch`` on ``sub``; returns ``{command: handler}``."""
    ks = sub.add_parser("keys", help="create CurveZMQ keys (server + client keypairs, allow-list)")
    ks.add_argument("dir", help="new key directory (must not hold keys yet)")
    ks.add_argument("--clients", type=int, default=1,
                    help="client keypairs: 'components' (shared by every process), then client-1 ... (default 1)")
    sb = sub.add_parser("sbatch", help="write a Slurm batch script that runs the job (busctl up --launcher slurm)")
    sb.add_argument("args", nargs="*", help="[CONFIG.yaml] [key.sub=value ...] (slurm.* shapes the job)")
    sb.add_argument("-o", "--output", default=None, help="write the script here (default: print it)")
    return {"keys": cmd_keys, "sbatch": cmd_sbatch}
