"""busctl: the command line of rlbus (this text is its --help: plain text, no markup).

    busctl up [CONFIG] [key.sub=value ...] [--dry-run]    run a job (default: configs/reverse_text.yaml)
    busctl up ... --overwrite                            the same in a run_dir that holds a previous run: delete it first
    busctl up --resume [RUN_DIR | CONFIG] [key=value ...] continue a stopped run in its run directory
    busctl status [RUN_DIR]                              components: state, pid, restarts, heartbeat, throughput, queues
    busctl logs [RUN_DIR] COMPONENT [-f]                 a component's log (-f: follow)
    busctl scale [RUN_DIR] rewards=N producers=M         resize a running job (either or both)
    busctl down [RUN_DIR]                                stop a running busctl up (SIGTERM; it drains)
    busctl keys DIR [--clients N]                        make CurveZMQ keys for an authenticated tcp:// bus
    busctl sbatch [CONFIG] [key=value ...] [-o FILE]     a Slurm batch script running the job (busctl up --launcher slurm)
    busctl report RUN_DIR [--out DIR]                    plots (PNG) and a text summary of a run
    busctl export RUN_DIR [--step N] --out DIR [--merge-lora]  a checkpoint as a Hugging Face model directory
    busctl eval [CONFIG] [key=value ...] [--run-dir DIR]  the eval tasks on model.path, no training (eval records)

RUN_DIR defaults to the default config's run_dir (runs/reverse_text). Errors go to stderr.

up never deletes a run it did not make: a run_dir that holds anything is refused (exit 2) with
what is there and the ways on: busctl up --resume RUN_DIR, another run_dir=, or --overwrite
(deletes a previous run's directory after naming each entry; a non-empty directory that holds
no run is refused even then). busctl sbatch checks the same when it writes the script.

up checks, before it starts anything: the config (a bad file or override names the file and
line, or the override, and the nearest known key), the device plan, the CurveZMQ key files,
model.path and teacher.model_path (a directory, or a hub id in the local HF cache), and every
task, reward, environment and agent name. --dry-run runs the same checks, prints the resolved
config and then the plan ('#' lines: the output stays YAML); an occupied run_dir is only warned
about (stderr).

up first plans the devices (busctl/placement.py): each component gets its own
CUDA_VISIBLE_DEVICES ('': no GPU), trainer.device, producers.dtype and broadcast.backend are
resolved (auto -> concrete) in the run's config.yaml, and a plan that does not fit the visible
GPUs is a bad config naming the keys and the devices seen.

up --launcher slurm (or supervisor.launcher: slurm) runs inside a Slurm allocation, each
component an srun step on its node (busctl/launchers/slurm.py); up --launcher ray
[--address ADDR] on a running Ray cluster, each component started by a Ray actor on its node
(busctl/launchers/ray.py).

up heals: a component that exits or stops sending heartbeats before the run is done is
restarted with exponential backoff (supervisor.* in the config); the packer continues from
its spool (RUN_DIR/packer/).

up --resume runs/reverse_text [overrides] continues a run that stopped (interrupted, failed,
or killed): it keeps the run directory (checkpoints/, metrics.jsonl, trained_samples.jsonl,
ledgers; logs are appended), reuses its config.yaml with the overrides applied on top and a
new broadcast port, and starts every component with RLBUS_RESUME=1 (the trainer continues
from its last checkpoint, the packer from its spool or, without one, numbers steps from that
checkpoint, the prompt source re-issues every prompt without an outcome in its ledger). Given
a config file instead of a directory, its run_dir is resumed.

scale talks to the busctl up of RUN_DIR (through RUN_DIR/scale.json) and waits until the new
set of components is ready: new replicas get the next indices (new producers join late,
RLBUS_LATE_JOIN=1; at most producers.max_replicas), removed ones are the highest indices,
stopped gracefully (SIGTERM, SIGKILL after 20 s); never fewer than one of each.

Exit codes: up: 0 when the trainer reached max_steps; 1 when a component failed (and could not
be restarted) or a run is already going in run_dir; 2 for a bad config (or a device plan that
does not fit, a model.path neither a directory nor in the local HF cache, an unknown task,
reward or environment, or a run_dir that holds another run); 130 when interrupted
(SIGINT/SIGTERM), after every process has stopped. scale: 0 done; 1 no running job, refused by
it, or not done in time; 2 bad arguments (also more producers than producers.max_replicas or
than the GPUs hold). Others: 0 ok, 1 failure, 2 bad usage.
"""

from __future__ import annotations

import argparse
import re

from rich.console import Console

# Each command module imports its heavy modules (configs, supervisor, run data, torch) inside its
# command functions, so building this parser (and `busctl --help`) stays fast.
from busctl import cluster_cli, evaluate, export, run_cli, up_cli
from busctl.run_cli import NoRun
from busctl.stderr import print_error
from busctl.up_cli import resume_config, supervise

__all__ = ["main", "resume_config", "supervise"]  # resume_config, supervise: re-exported for tests and callers


def _plain(text: str) -> str:
    """``text`` without reStructuredText roles and literals (``:mod:`x``` -> x, ````x```` -> x): what a
    terminal shows for --help."""
    return re.sub(r":[a-z]+:`([^`]*)`", r"\1", text).replace("``", "")


def _cmd_report(ns: argparse.Namespace, console: Console) -> int:
    """``busctl report``: :func:`busctl.report.cmd_report`, imported when the command runs (it reads
    metrics with prometheus_client's parser)."""
    from busctl.report import cmd_report

    return cmd_report(ns, console)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit code."""
    parser = argparse.ArgumentParser(
        prog="busctl",
        description="Run and inspect rlbus pipelines.",
        epilog=_plain(__doc__.split("\n\n", 1)[1]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    handlers = {
        **up_cli.add_up(sub),
        **run_cli.add_commands(sub),
        **cluster_cli.add_commands(sub),
        **export.add_command(sub),
        **evaluate.add_command(sub),
    }
    rp = sub.add_parser("report", help="plot a run's metrics (PNG) and print a short summary")
    rp.add_argument("run_dir", help="run directory (holds metrics.jsonl)")
    rp.add_argument("--out", default=None, help="where to write the plots and summary.txt (default: RUN_DIR/report)")
    handlers["report"] = _cmd_report
    ns = parser.parse_args(argv)
    console = Console(highlight=False, soft_wrap=True)  # never break paths or messages mid-line
    try:
        return handlers[ns.command](ns, console)
    except NoRun as err:
        print_error(f"busctl {ns.command}: {err}")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
