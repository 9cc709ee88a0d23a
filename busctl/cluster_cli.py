"""The multi-host commands of ``busctl``: ``keys`` (CurveZMQ keys) and ``sbatch`` (a Slurm batch script).

:func:`add_commands` registers both subcommands on the ``busctl`` parser and returns their
handlers, which take ``(namespace, console)`` and return the exit code (0 ok, 1 failure, 2 bad
config), like the others in :mod:`busctl.cli`.
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import Callable

from rich.console import Console

from busctl.stderr import print_error, print_warning

# the config and run-directory modules are imported by the commands: busctl --help imports this one


def cmd_keys(ns: argparse.Namespace, console: Console) -> int:
    """``busctl keys DIR [--clients N] [--hosts SPEC] [--no-resolve]``: create a CurveZMQ key directory
    with the metrics TLS files, one server certificate per host (:mod:`telemetry.certs`; only those
    when DIR holds keys without them), and say how to use it."""
    from bus.auth import CLIENTS_DIR, create_keys  # zmq only
    from telemetry.certs import default_hosts, parse_hosts

    keys_dir = Path(ns.dir).resolve()
    try:
        hosts = parse_hosts(ns.hosts) if ns.hosts is not None else default_hosts()
        hosts = hosts if ns.no_resolve else [h.with_addresses() for h in hosts]
        created = create_keys(keys_dir, ns.clients, hosts)
    except ValueError as err:
        print_error(str(err))
        return 1
    print(f"CurveZMQ keys and metrics TLS files in {keys_dir} (mode 0700; *.key_secret and tls/*.key are secret):")
    for path in created:
        print(f"  {path}")
    print(f"allow-list: {keys_dir / CLIENTS_DIR}/*.key (every public key there may connect)")
    print(
        f"metrics:    with tcp, /metrics and /health are HTTPS and need the client certificate "
        f"{keys_dir}/tls/client.crt"
    )
    print(
        f"            (+ client.key, CA tls/ca.crt), e.g. curl --cacert {keys_dir}/tls/ca.crt --cert "
        f"{keys_dir}/tls/client.crt \\"
    )
    print(f"            --key {keys_dir}/tls/client.key https://HOST:PORT/metrics")
    print("server certificates (readers check that the one served names the host they connect to):")
    for host in hosts:
        print(f"            tls/hosts/{host.name}.crt: {', '.join(host.all)}")
    print(f"use:        busctl up CONFIG bus.transport=tcp bus.curve_keys_dir={keys_dir}")
    print("multi-host: copy the directory to the same path on every host, keeping it private, each host")
    print(
        f"            with only its own tls/hosts/ key, e.g. rsync -a --exclude 'tls/hosts/*.key' {keys_dir}/ "
        f"HOST:{keys_dir}/"
    )
    print(f"            then rsync {keys_dir}/tls/hosts/HOST.key HOST:{keys_dir}/tls/hosts/")
    print("            a host with its own client keypair sets bus.curve_client=NAME; to revoke one,")
    print(f"            delete {CLIENTS_DIR}/NAME.key on every host and restart the processes that bind")
    return 0


def cmd_sbatch(ns: argparse.Namespace, console: Console) -> int:
    """``busctl sbatch [CONFIG] [key=value ...] [-o FILE] [--overwrite]``: write the job's batch script
    (:func:`busctl.launchers.sbatch.sbatch_script`) to FILE, or print it. An occupied ``run_dir`` is
    refused here already (exit 2, :mod:`busctl.run_dir`) unless ``--overwrite``, which the job's
    ``busctl up`` is given."""
    from bus.auth import check_keys  # zmq only
    from busctl.launchers.sbatch import sbatch_script
    from busctl.run_dir import inspect_run_dir, refusal
    from configs.schema import ConfigError, load_config

    config_path, overrides = (ns.args[0], ns.args[1:]) if ns.args and "=" not in ns.args[0] else (None, ns.args)
    try:
        cfg = load_config(config_path, overrides)
        check_keys(cfg.bus)  # a bus.curve_keys_dir given must hold keys (the config does not read them)
        script = sbatch_script(
            cfg, str(Path(config_path).resolve()) if config_path else None, overrides, overwrite=ns.overwrite
        )
        occupant = inspect_run_dir(Path(cfg.run_dir))  # the job's busctl up checks again when it starts
    except (ConfigError, ValueError) as err:
        print_error(str(err))
        return 2
    if occupant is not None and not (ns.overwrite and occupant.is_run):
        given = ["busctl", "sbatch", *ns.args, *(["-o", ns.output] if ns.output else [])]
        elsewhere = [a for a in given if not a.startswith("run_dir=")] + [f"run_dir={cfg.run_dir}-2"]
        print_error(refusal(occupant, shlex.join(given), shlex.join(elsewhere)))
        return 2
    if occupant is not None:
        print_warning(
            f"the job's busctl up --overwrite will delete the previous run in {occupant.run_dir}: {occupant.what()}"
        )
    if ns.output:
        Path(ns.output).write_text(script)
        console.print(f"wrote {ns.output}; submit it with: sbatch {ns.output}")
    else:
        print(script, end="")
    return 0


def add_commands(sub: argparse._SubParsersAction) -> dict[str, Callable[[argparse.Namespace, Console], int]]:
    """Register ``keys`` and ``sbatch`` on ``sub``; returns ``{command: handler}``."""
    ks = sub.add_parser(
        "keys",
        help="create CurveZMQ keys (server + client keypairs, allow-list) and the metrics TLS "
        "certificates (CA, server, client)",
    )
    ks.add_argument(
        "dir", help="new key directory (must not hold keys yet; one with CurveZMQ keys but no tls/ gets the TLS files)"
    )
    ks.add_argument(
        "--clients",
        type=int,
        default=1,
        help="client keypairs: 'components' (shared by every process), then client-1 ... (default 1)",
    )
    ks.add_argument(
        "--hosts",
        default=None,
        metavar="SPEC",
        help="metrics TLS: one server certificate per host, hosts separated by ',', each NAME or "
        "NAME=ALIAS+ALIAS (host names or IP addresses), e.g. node1=10.0.0.1,node2=10.0.0.2; name every "
        "address a component there serves metrics on (its node address under Slurm/Ray, 127.0.0.1 "
        "locally). Default: this machine (its host name, localhost, 127.0.0.1, ::1). Fixed once made: "
        "the CA's key is discarded, a new host needs a new directory",
    )
    ks.add_argument(
        "--no-resolve",
        action="store_true",
        help="do not add the addresses each host name resolves to here (default: added)",
    )
    sb = sub.add_parser("sbatch", help="write a Slurm batch script that runs the job (busctl up --launcher slurm)")
    sb.add_argument("args", nargs="*", help="[CONFIG.yaml] [key.sub=value ...] (slurm.* shapes the job)")
    sb.add_argument("-o", "--output", default=None, help="write the script here (default: print it)")
    sb.add_argument(
        "--overwrite",
        action="store_true",
        help="the job runs busctl up --overwrite: a previous run in run_dir is deleted when the job starts "
        "(without it, busctl sbatch and the job refuse an occupied run_dir)",
    )
    return {"keys": cmd_keys, "sbatch": cmd_sbatch}
