"""busctl: the command line of rlbus (``python -m busctl``).

:func:`main` builds the parser from the command modules (each imports its heavy modules inside its command
functions, so ``busctl --help`` stays fast) and runs one command; :data:`HELP` is the plain-text epilog of
``--help``. What each command does, and its exit codes, is in docs/operations.md.
"""

from __future__ import annotations

import argparse

from rich.console import Console

# Each command module imports its heavy modules (configs, supervisor, run data, torch) inside its
# command functions, so building this parser (and `busctl --help`) stays fast.
from busctl import cluster_cli, evaluate, export, run_cli, serve_cli, up_cli
from busctl.run_cli import NoRun
from busctl.stderr import print_error
from busctl.up_cli import resume_config, supervise

__all__ = ["main", "resume_config", "supervise"]  # resume_config, supervise: re-exported for tests and callers

HELP = """\
    busctl up [CONFIG] [key.sub=value ...] [--dry-run]    run a job (default: configs/reverse_text.yaml)
    busctl up ... --overwrite                            the same in a run_dir holding a previous run: delete it first
    busctl up --resume [RUN_DIR | CONFIG] [key=value ...] continue a stopped run in its run directory
    busctl status [RUN_DIR]                              components: state, pid, restarts, heartbeat, throughput, queues
    busctl logs [RUN_DIR] COMPONENT [-f]                 a component's log (-f: follow)
    busctl scale [RUN_DIR] rewards=N producers=M servers=S  resize a running job (servers: per producer)
    busctl down [RUN_DIR]                                stop a running busctl up (SIGTERM; it drains)
    busctl serve [CONFIG] [key.sub=value ...]            serve the Tinker API over the bus (docs/service.md)
    busctl keys DIR [--clients N]                        make CurveZMQ keys for an authenticated tcp:// bus
    busctl sbatch [CONFIG] [key=value ...] [-o FILE]     a Slurm batch script running the job (up --launcher slurm)
    busctl report RUN_DIR [--out DIR]                    plots (PNG) and a text summary of a run
    busctl export RUN_DIR [--step N] --out DIR [--merge-lora]  a checkpoint as a Hugging Face model directory
    busctl eval [CONFIG] [key=value ...] [--run-dir DIR]  the eval tasks on model.path, no training (eval records)

RUN_DIR defaults to the default config's run_dir (runs/reverse_text). Errors go to stderr.

up checks the config, the device plan, the key files, model paths and every task, reward, environment
and agent name before it starts anything (--dry-run: only that, then prints the resolved config and
plan). It refuses a run_dir that holds anything (ways on: --resume, another run_dir=, --overwrite),
restarts a component that dies (supervisor.*), and runs on Slurm or Ray with --launcher slurm|ray.

Exit codes: up: 0 the trainer reached max_steps; 1 a component failed past its restarts, or a run is
already going in run_dir; 2 a bad config, device plan, model path, name or occupied run_dir; 130
interrupted (SIGINT/SIGTERM), after every process stopped. scale: 0 done; 1 no running job, refused or
not done in time; 2 bad arguments. Others: 0 ok, 1 failure, 2 bad usage. More: docs/operations.md.
"""


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
        epilog=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    handlers = {
        **up_cli.add_up(sub),
        **run_cli.add_commands(sub),
        **cluster_cli.add_commands(sub),
        **export.add_command(sub),
        **evaluate.add_command(sub),
        **serve_cli.add_command(sub),
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
