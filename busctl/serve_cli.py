"""``busctl serve [CONFIG] [key=value ...]``: run rlbus as a training and sampling service (docs/service.md):
the hub, the API trainer (``trainer.api.proc``) and the HTTP API (``service.proc``) under a
:class:`busctl.supervisor.Supervisor`, which starts, watches, heals and logs them like any run's; ``busctl
status/logs/down`` work on it. It serves until stopped (``busctl down``, Ctrl-C). The API's address is printed
and written to ``RUN_DIR/serve.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

from rich.console import Console

from busctl.run_cli import split_config_args
from busctl.stderr import print_error


def cmd_serve(ns: argparse.Namespace, console: Console) -> int:
    """``busctl serve``: exit 2 for a bad config, no API keys or an occupied run directory; else 130 when
    stopped (or 1 if the service failed)."""
    from bus.auth import check_keys
    from busctl.components.placement import apply_placement
    from busctl.run_dir import inspect_run_dir, overwrite
    from busctl.startup import process_started_at
    from busctl.supervisor import Supervisor
    from busctl.up_cli import supervise
    from configs.model_path import resolve_run_model_paths
    from configs.schema import load_config
    from service.keys import load_keys
    from service.proc import tls_files

    config_path, overrides = split_config_args(ns.args)
    try:
        cfg = load_config(config_path, [*overrides, "serve.only=true"])
        placement = apply_placement(cfg)
        check_keys(cfg.bus)
        resolve_run_model_paths(cfg)
        load_keys(cfg.serve.api_keys_file)
        tls_files(cfg.bus, cfg.serve.host)  # a run with keys serves HTTPS: a certificate for serve.host
        occupant = inspect_run_dir(Path(cfg.run_dir))
    except (ValueError, FileNotFoundError) as err:
        print_error(str(err))
        return 2
    if occupant is not None and not (ns.overwrite and occupant.is_run):
        print_error(f"{cfg.run_dir} is not empty: {occupant.what()}; give another run_dir= or --overwrite")
        return 2
    if occupant is not None:
        overwrite(occupant, lambda line: console.print(line, markup=False))
    sup = Supervisor(cfg, console, launched_at=process_started_at(os.getpid()), placement=placement)

    def on_signal(signum: int, _frame: object) -> None:
        sup.stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    original_start = sup.start

    def start_and_say() -> None:
        original_start()
        url = json.loads((sup.run_dir / "serve.json").read_text())["url"]
        console.print(f"serving the Tinker API on {url} (models: {', '.join([cfg.model.path, *cfg.serve.models])})")

    sup.start = start_and_say  # type: ignore[method-assign]
    return supervise(sup, console)


def add_command(sub: argparse._SubParsersAction) -> dict:
    """Register ``serve`` on ``sub``; returns ``{"serve": handler}``."""
    p = sub.add_parser(
        "serve",
        help="serve the Tinker API (training and sampling clients) over the bus",
        description="busctl serve [CONFIG] [key.sub=value ...]: the hub, a trainer and the HTTP API "
        "(serve.host, serve.port); API keys from RLBUS_SERVE_API_KEYS or serve.api_keys_file.",
    )
    p.add_argument("args", nargs="*", help="[CONFIG.yaml] [key.sub=value ...]")
    p.add_argument("--overwrite", action="store_true", help="delete a previous run in run_dir first")
    return {"serve": cmd_serve}
