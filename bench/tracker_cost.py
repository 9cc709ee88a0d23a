"""What the experiment trackers cost: the tracker process's CPU time and wall time to log a finished
run's files, per tracker (``report.trackers``), on a copy of the run directory.

    python bench/tracker_cost.py RUN_DIR [--trackers tensorboard wandb mlflow]

For each tracker: copy ``config.yaml``, ``metrics.jsonl``, ``eval.jsonl``, ``stages.jsonl`` and ``samples.jsonl``
of RUN_DIR to a temporary directory, run ``python -m trackers --run-dir COPY`` (the process
``busctl up`` starts), stop it with SIGTERM once it read every file, and report its user + system
CPU seconds (``os.wait4``'s rusage, the process and its reaped children; W&B's service process is
not a child that is reaped here, so its share is not counted) and the wall time to
the end of the drain. The number to compare is the trainer's step time: the process runs at
nice +10 beside the pipeline, so its CPU is taken only when a core is idle. W&B runs offline
(``WANDB_MODE=offline``); MLflow writes a file store in the copy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
FILES = ("metrics.jsonl", "eval.jsonl", "stages.jsonl", "samples.jsonl")


def measure(run_dir: Path, tracker: str, work: Path) -> dict:
    """Log ``run_dir``'s files to ``tracker`` in a copy under ``work``; ``{cpu_s, wall_s, steps, offsets_ok}``."""
    copy = work / tracker
    copy.mkdir()
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["run_dir"] = str(copy)
    config.setdefault("report", {})["trackers"] = [tracker]
    (copy / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    sizes = {}
    for name in FILES:
        if (run_dir / name).is_file():
            shutil.copy(run_dir / name, copy / name)
            sizes[name] = (copy / name).stat().st_size
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "trackers", "--run-dir", str(copy), "--poll-s", "0.2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state_path = copy / "trackers" / "state.json"
    deadline = start + 600
    while time.monotonic() < deadline:  # until every file was read to its end
        try:
            offsets = json.loads(state_path.read_text()).get("offsets", {})
        except (OSError, ValueError):
            offsets = {}
        if all(offsets.get(k) == v for k, v in sizes.items()):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - start
    state = json.loads(state_path.read_text())
    steps = sum(1 for line in (copy / "metrics.jsonl").open() if line.strip())
    return {
        "tracker": tracker,
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "wall_s": round(wall, 2),
        "step_records": steps,
        "failed": state.get("failed", {}),
        "exit": os.waitstatus_to_exitcode(status),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--trackers", nargs="+", default=["tensorboard", "wandb", "mlflow"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for tracker in args.trackers:
            print(json.dumps(measure(args.run_dir.resolve(), tracker, Path(tmp))))


if __name__ == "__main__":
    main()
