"""The default job with the producer's engine in-process (`producers.engine: vllm`) and on a vLLM server it
starts (`producers.engine: server`): samples/s and the eval reward's rise, arms alternated run by run.

Each run is `busctl up CONFIG --overwrite run_dir=TMP [overrides]` to its end. Samples/s is the trained samples
of steps 2..N over the sum of their `step_time_s` (step 1 carries start-up); the learning figure is the last
eval round's `reward_mean` minus round 0's (the issue's bar: +0.15 through a server). Both arms use the bus
weight method (the server engine's default) so that only the engine differs.

    python -m bench.server_vs_inprocess [--runs 1] [--arms in-process,server] [--work-dir DIR] [CONFIG] [overrides ...]

`--work-dir` keeps each run's directory (`DIR/<arm>-<run>`: eval.jsonl, metrics.jsonl, logs); default a temporary
directory, removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {"in-process": ["producers.engine=vllm"], "server": ["producers.engine=server", "bus.ready_timeout_s=900"]}


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_once(config: str, overrides: list[str], run_dir: Path, timeout_s: float) -> dict[str, float]:
    """One run to its end: samples/s of steps 2.., eval reward first/last round, wall seconds."""
    cmd = [sys.executable, "-m", "busctl", "up", "--overwrite", config, f"run_dir={run_dir}", *overrides]
    started = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - started
    if out.returncode != 0:
        raise RuntimeError(f"busctl up exited {out.returncode}: see {run_dir}/logs\n{out.stdout[-2000:]}")
    steps = [m for m in _jsonl(run_dir / "metrics.jsonl") if "loss" in m][1:]
    evals = sorted(_jsonl(run_dir / "eval.jsonl"), key=lambda r: r["step"])
    key = next(k for k in evals[0] if k.endswith("/reward_mean"))
    return {
        "samples_per_s": sum(m["num_samples"] for m in steps) / sum(m["step_time_s"] for m in steps),
        "eval_first": evals[0][key],
        "eval_last": evals[-1][key],
        "eval_rounds": {r["step"]: round(r[key], 4) for r in evals},
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms, in the order run")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep the run directories here")
    parser.add_argument("config", nargs="?", default="configs/reverse_text.yaml")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; known: {list(ARMS)}")
    rows = []
    with contextlib.ExitStack() as stack:
        if args.work_dir is None:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rlbus-server-bench-")))
        else:
            work = args.work_dir
            work.mkdir(parents=True, exist_ok=True)
        for i in range(args.runs):
            for arm in arms:
                overrides = ["broadcast.method=bus", *ARMS[arm], *args.overrides]
                result = run_once(args.config, overrides, work / f"{arm}-{i}", args.timeout_s)
                rows.append({"arm": arm, "run": i, **result})
                print(json.dumps(rows[-1]), flush=True)
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm]
        sps = sorted(r["samples_per_s"] for r in mine)[len(mine) // 2]
        rise = sorted(r["eval_last"] - r["eval_first"] for r in mine)[len(mine) // 2]
        print(f"{arm:>10}: median samples/s {sps:.1f}, eval reward rise {rise:+.3f} ({len(mine)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
