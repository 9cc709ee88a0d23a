"""Launch to first optimizer step of ``busctl up``, per phase, median of ``--runs`` launches.

Each launch runs ``busctl up CONFIG --overwrite run_dir=TMP [overrides]``, stops it (SIGTERM) once
``RUN_DIR/startup.json`` is written, and reads the phases from that file and the producer's log: busctl's
own start (launch to the first spawn), the producer's vLLM import (first vLLM log line), its EngineCore's
start (the EngineCore's first line), the engine's init and warm-up ("vLLM engine up"), the producer and
trainer ready (the trainer is ready once the weight group with the producers is up) and the first step.
vLLM's own stamps have 1 s resolution. The policy must be cached (run once before).

    python -m bench.first_step [--runs 3] [--before DIR] [CONFIG] [overrides ...]

``--before DIR`` (an older tree, ``git archive COMMIT | tar -x -C DIR``) launches from that tree too,
alternating launch by launch so both see the same load on a shared host.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
_VLLM_STAMP = re.compile(r"^\((MainProcess|EngineCore)[^)]*\) \w+ (\d\d-\d\d \d\d:\d\d:\d\d)")
_RLBUS_STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def producer_phases(log: str, launched_at: float) -> dict[str, float]:
    """Seconds since launch at which the producer's log shows: ``vllm_imported`` (its first vLLM line),
    ``engine_core_up`` (the EngineCore's first line) and ``engine_up`` (``vLLM engine up``)."""
    year = datetime.fromtimestamp(launched_at).year
    phases: dict[str, float] = {}
    for line in log.splitlines():
        if m := _VLLM_STAMP.match(line):
            at = datetime.strptime(f"{year}-{m.group(2)}", "%Y-%m-%d %H:%M:%S").timestamp()
            key = "vllm_imported" if m.group(1) == "MainProcess" else "engine_core_up"
            phases.setdefault(key, round(at - launched_at, 1))
        elif "vLLM engine up" in line and (m := _RLBUS_STAMP.match(line)):
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            phases.setdefault("engine_up", round(at - launched_at, 2))
    return phases


def launch(tree: Path, config: str, overrides: list[str], run_dir: Path, timeout_s: float) -> dict[str, float]:
    """One ``busctl up`` from ``tree`` to its first step: the phases in seconds since launch."""
    if not (tree / ".cache").exists():  # the cached policy
        (tree / ".cache").symlink_to(REPO_ROOT / ".cache")
    config = str((REPO_ROOT / config).resolve())
    cmd = [sys.executable, "-m", "busctl", "up", "--overwrite", config, f"run_dir={run_dir}", *overrides]
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    startup = run_dir / "startup.json"
    deadline = time.monotonic() + timeout_s
    while not startup.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    code = proc.poll()
    proc.send_signal(signal.SIGTERM)  # what busctl down sends
    try:
        proc.wait(timeout=600)  # a loaded host: components stop slowly
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if not startup.exists():
        raise RuntimeError(f"no first step (busctl up exit code {code}) within {timeout_s} s: see {run_dir}/logs")
    record = json.loads(startup.read_text())
    comps = record["components"]
    phases = {"first_spawn": min(c["spawned_s"] for c in comps.values())}
    phases.update(producer_phases((run_dir / "logs" / "producer-0.log").read_text(), record["launched_at"]))
    others = [c["ready_s"] for name, c in comps.items() if name not in ("trainer", "producer-0")]
    phases.update(
        others_ready=max(others),
        producer_ready=comps["producer-0"]["ready_s"],
        trainer_ready=comps["trainer"]["ready_s"],
        first_step=record["first_step_s"],
    )
    return phases


def main(argv: list[str] | None = None) -> int:
    """Print each launch's phases and their medians."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="launches (default 3); medians are reported")
    parser.add_argument("--before", type=Path, default=None, help="an older source tree to time against this one")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a first step")
    parser.add_argument("config", nargs="?", default="configs/reverse_text.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    trees = {"this tree": REPO_ROOT, **({"before": args.before.resolve()} if args.before else {})}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="rlbus-first-step-") as tmp:
        for k in range(args.runs):
            for name, tree in trees.items():
                run_dir = Path(tmp) / f"{name.replace(' ', '-')}-{k}"
                phases = launch(tree, args.config, args.overrides, run_dir, args.timeout)
                rows[name].append(phases)
                print(f"{name} {k + 1}: " + ", ".join(f"{key} {v:.1f}" for key, v in phases.items()), flush=True)
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    for name, runs in rows.items():
        print(f"{name}: medians of {args.runs} (seconds since launch)")
        for key in runs[0]:
            values = [r[key] for r in runs if key in r]
            print(f"  {key:15s} {statistics.median(values):6.1f}  ({', '.join(f'{v:.1f}' for v in values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
