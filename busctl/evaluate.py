"""``busctl eval [CONFIG] [key=value ...] [--run-dir DIR]``: evaluate a policy without training.

The run's own evaluation path, minus the trainer: the job of CONFIG runs with :data:`EVAL_OVERRIDES`
(``eval.only``: no trainer in the table, the prompt source issues eval round 0 alone, weights stay those of
``model.path`` at policy version 0, every visible GPU is the producers'). Producers sample the round, reward
workers score it, the packer summarises it per task and writes the records to ``RUN_DIR/eval.jsonl`` as in a
training run; :class:`busctl.eval_supervisor.EvalSupervisor` ends the run once every task has its result, and the
records are printed on stdout. A LoRA adapter is refused (merge it with ``busctl export
--merge-lora``); the run directory defaults to ``run_dir`` + ``-eval`` and never touches a training run's
(docs/operations.md, "Evaluating a model without training"). Exit codes: 0 every task has its result; 1 a
component failed or a result did not come within ``eval.timeout_s``; 2 a bad config; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from busctl.stderr import print_error

if TYPE_CHECKING:  # imported where used: every busctl command (--help too) imports this module
    from rich.table import Table

    from configs.schema import RunConfig

__all__ = ["EVAL_OVERRIDES", "add_command", "eval_config"]

EVAL_OVERRIDES = (
    "eval.only=true",
    "eval.enabled=true",
    "broadcast.method=filesystem",
    "trainer.device=cpu",
    "trainer.gpus=[]",
    "trainer.data_parallel=1",
)
"""Applied after the user's overrides: what makes a job an evaluation; the ``trainer.*`` ones keep the device plan
from reserving a GPU for the trainer that does not run."""

SHOWN = ("reward_mean", "reward_std", "completion_len_mean")
"""Metrics of the summary table (besides every ``pass_at_*``)."""


def eval_config(config_path: str | None, overrides: list[str], run_dir: str | None = None) -> RunConfig:
    """The config ``busctl eval`` runs: CONFIG (None: the default) with ``overrides``, then :data:`EVAL_OVERRIDES`;
    ``run_dir`` None: a ``run_dir=`` override, else the config's ``run_dir`` + ``-eval``.

    Raises:
        ConfigError: an invalid config or override, or ``model.path`` a LoRA adapter directory.
    """
    from configs.schema import ConfigError, load_config

    cfg = load_config(config_path, [*overrides, *EVAL_OVERRIDES])
    if run_dir is not None:
        cfg.run_dir = run_dir
    elif not any(o.partition("=")[0].strip() == "run_dir" for o in overrides):
        cfg.run_dir = f"{cfg.run_dir.rstrip('/')}-eval"
    path = Path(cfg.model.path) if cfg.model.path else None
    if path is not None and (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        raise ConfigError(
            f"model.path={path} is a LoRA adapter; vLLM serves whole models: merge it first with "
            f"`busctl export RUN_DIR --step N --out DIR --merge-lora` and evaluate model.path=DIR"
        )
    return cfg


def summary_table(cfg: RunConfig, results: dict) -> Table:
    """One row per eval task: samples, failed groups and the :data:`SHOWN` / ``pass_at_*`` metrics."""
    from rich.table import Table

    keys = list(SHOWN) + sorted({k for r in results.values() for k in r.metrics if k.startswith("pass_at_")})
    table = Table(title=f"eval of {cfg.model.path}")
    for col in ("task", "samples", "failed", *keys):
        table.add_column(col, justify="left" if col == "task" else "right")
    for task, r in sorted(results.items()):
        table.add_row(
            task,
            str(r.num_samples),
            str(r.num_failed),
            *(f"{r.metrics[k]:.4f}" if k in r.metrics else "-" for k in keys),
        )
    return table


def cmd_eval(ns: argparse.Namespace, console: Console) -> int:
    """``busctl eval``: the exit code."""
    from bus.auth import check_keys
    from busctl.eval_supervisor import EvalSupervisor
    from busctl.launchers import make_launcher
    from busctl.components.placement import apply_placement
    from busctl.run_cli import split_config_args
    from busctl.run_dir import holds_eval_run, inspect_run_dir, overwrite
    from busctl.startup import process_started_at
    from busctl.up_cli import supervise
    from configs.model_path import resolve_run_model_paths
    from runfiles.eval_records import eval_record

    config_path, overrides = split_config_args(ns.args)
    try:
        cfg = eval_config(config_path, overrides, ns.run_dir)
        placement = apply_placement(cfg)
        check_keys(cfg.bus)
        launcher = make_launcher(cfg)
        resolve_run_model_paths(cfg)
        occupant = inspect_run_dir(Path(cfg.run_dir))
    except (ValueError, FileNotFoundError) as err:  # ConfigError is a ValueError
        print_error(f"busctl eval: {err}")
        return 2
    if occupant is not None and not (occupant.is_run and holds_eval_run(occupant)):  # never a training run's directory
        print_error(
            f"busctl eval: run directory {occupant.run_dir} holds something other than a previous eval: "
            f"{occupant.what()}.\nbusctl eval deletes nothing there: give another --run-dir (default: the "
            "config's run_dir + '-eval'), or empty that directory yourself"
        )
        return 2
    if occupant is not None:  # a previous eval's outputs: named, then replaced
        overwrite(
            occupant, lambda line: console.print(line, markup=False), why="busctl eval replaces its previous eval"
        )
    launcher.configure(cfg)
    sup = EvalSupervisor(
        cfg, console, launched_at=process_started_at(os.getpid()), placement=placement, launcher=launcher
    )

    def on_signal(signum: int, _frame: object) -> None:
        sup.stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = supervise(sup, console)
    if sup.results:
        wide = (
            console if console.is_terminal else Console(highlight=False, soft_wrap=True, width=max(console.width, 140))
        )
        wide.print(summary_table(cfg, sup.results))
        for task in sorted(sup.results):
            print(json.dumps(eval_record(sup.results[task])), flush=True)
    return code


def add_command(sub: argparse._SubParsersAction) -> dict[str, Callable[[argparse.Namespace, Console], int]]:
    """Register ``eval`` on the ``busctl`` subparsers ``sub``; returns ``{"eval": handler}``."""
    ev = sub.add_parser(
        "eval",
        help="evaluate a policy on the config's eval tasks without training",
        description="Run the config's eval tasks through the producers and reward workers on model.path "
        "(eval.only: no trainer, eval round 0 only); print the eval records (the packer writes them to "
        "RUN_DIR/eval.jsonl). Evaluate a checkpoint: busctl eval CONFIG model.path=RUN_DIR/checkpoints/step_N.",
    )
    ev.add_argument("args", nargs="*", help="[CONFIG.yaml] [key.sub=value ...], e.g. model.path=DIR")
    ev.add_argument(
        "--run-dir",
        default=None,
        help="the eval run directory (default: the config's run_dir + '-eval'); a previous eval there is replaced, "
        "anything else refused",
    )
    return {"eval": cmd_eval}
