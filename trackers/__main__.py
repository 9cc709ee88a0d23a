"""The tracker process: ``python -m trackers --run-dir RUN_DIR`` (started by ``busctl up``, :mod:`trackers.launch`).

Polls the run's JSONL files every ``--poll-s`` seconds for ``report.trackers`` until SIGTERM or SIGINT, reads
them a last time and closes every tracker. It runs at ``nice`` +10 (never taking CPU from the pipeline), dies
with its parent (a SIGTERM: it still drains) and exits 0 even when every tracker failed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import yaml

NICE = 10
"""Added to the tracker process's nice value."""


def main(argv: list[str] | None = None) -> int:
    """Run the tracker process; returns its exit code (2: bad arguments or config)."""
    parser = argparse.ArgumentParser(
        prog="python -m trackers", description="Feed report.trackers from a run directory."
    )
    parser.add_argument("--run-dir", required=True, help="run directory holding config.yaml and the JSONL files")
    parser.add_argument("--poll-s", type=float, default=1.0, help="seconds between reads of the files (default 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.poll_s <= 0:
        print(f"--poll-s must be > 0, got {args.poll_s}", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir).resolve()
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        print(f"cannot read {run_dir / 'config.yaml'}: {err}", file=sys.stderr)
        return 2
    names = list((config.get("report") or {}).get("trackers") or [])
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        os.nice(NICE)
    except OSError:
        pass
    from lifecycle.parent_death import die_with_parent

    die_with_parent(signal.SIGTERM)
    from trackers.follower import TrackerFollower

    follower = TrackerFollower(run_dir, names, config)
    logging.info("trackers %s following %s", [t.name for t in follower.trackers], run_dir)
    while not stop.wait(args.poll_s):
        try:
            follower.poll()
        except OSError as err:
            logging.warning("reading the run's files failed (%s); trying again", err)
    try:
        follower.poll()
    except OSError as err:
        logging.warning("last read of the run's files failed: %s", err)
    follower.close()
    logging.info(
        "trackers closed; %d malformed lines dropped; failed: %s", follower.malformed, follower.failed or "none"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
