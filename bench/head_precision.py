"""LM-head precision (`trainer.lm_head_dtype`) against the sampler: the training/inference mismatch
and the trainer's step time of each setting, from short real `busctl up` runs.

Run: ``python -m bench.head_precision [--steps 8] [--rounds 1] [--out-dir DIR] [--config CONFIG]
[--setting TRAINER_DTYPE/HEAD_DTYPE ...] [--override key=value ...]``

Each setting (`trainer.dtype`/`trainer.lm_head_dtype`) runs ``busctl up`` at `max_async_level=0`, rounds
interleaved over settings, so every sample comes from the weights being trained (checked) and the step's `kl`
(Schulman's k3 of KL(pi_sampler || pi_train), nats) is the pure mismatch. Reported: `kl` median and max,
`sqrt(2 kl)` (the RMS logprob difference to second order: k3 = d^2/2 + O(d^3)), the largest on-policy
|logprob difference, trainer compute and step time, and `other_cpu_cores` (the host's busy cores not ours,
from `/proc/stat` less our `RUSAGE_CHILDREN`). Logs and `results.json` go to `--out-dir`. Results:
bench/README.md, "LM-head precision: mismatch against the sampler".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

DEFAULT_SETTINGS = ("float32/float32", "float32/bfloat16", "bfloat16/float32", "bfloat16/bfloat16", "bfloat16/tf32")
"""`trainer.dtype/trainer.lm_head_dtype` pairs measured by default."""

COMPUTE_PHASES = ("forward", "backward", "optimizer")
"""Phases of `trainer.observability.step_timing` counted as the trainer's own compute per step."""


def parse_setting(text: str) -> tuple[str, str]:
    """`"bfloat16/tf32"` -> `("bfloat16", "tf32")` (trainer.dtype, trainer.lm_head_dtype).

    Raises:
        ValueError: not of the form TRAINER_DTYPE/HEAD_DTYPE.
    """
    dtype, sep, head = text.partition("/")
    if not sep or not dtype or not head or "/" in head:
        raise ValueError(f"a setting is TRAINER_DTYPE/HEAD_DTYPE (e.g. bfloat16/float32), got {text!r}")
    return dtype, head


def step_records(metrics_path: Path) -> list[dict[str, Any]]:
    """The optimizer-step records of a run's `metrics.jsonl` (those with a `loss`), in step order."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if "loss" in r and "step" in r), key=lambda r: r["step"])


def summarize(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Per-run summary of its step records (see the module docstring for each key).

    Keys: `steps`, `onpolicy_share` (on-policy loss tokens / loss tokens over the run), `kl_median`,
    `kl_max`, `rms_lp_diff` (sqrt(2 * kl_median)), `lp_diff_max_median`, `lp_diff_max`,
    `compute_s_median`, `step_time_s_median`; nats and seconds.

    Raises:
        ValueError: no step records.
    """
    if not steps:
        raise ValueError("the run recorded no optimizer step in metrics.jsonl")
    kl = [float(s["kl"]) for s in steps]
    lp_max = [float(s.get("onpolicy_lp_diff_max", math.nan)) for s in steps]
    compute = [sum(float(s.get(f"time/{p}_s", 0.0)) for p in COMPUTE_PHASES) for s in steps]
    loss_tokens = sum(float(s.get("num_loss_tokens", 0.0)) for s in steps)
    kl_median = statistics.median(kl)
    return {
        "steps": float(len(steps)),
        "onpolicy_share": sum(float(s.get("onpolicy_tokens", 0.0)) for s in steps) / loss_tokens
        if loss_tokens
        else math.nan,
        "kl_median": kl_median,
        "kl_max": max(kl),
        "rms_lp_diff": math.sqrt(2.0 * max(kl_median, 0.0)),
        "lp_diff_max_median": statistics.median(lp_max),
        "lp_diff_max": max(lp_max),
        "compute_s_median": statistics.median(compute),
        "step_time_s_median": statistics.median(float(s.get("step_time_s", math.nan)) for s in steps),
    }


def markdown_table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    """A markdown table of `(trainer_dtype, head_dtype, summary)` rows (:func:`summarize`, plus
    `other_cpu_cores_max`: the most cores other processes took during one of the setting's runs)."""
    lines = [
        "| trainer.dtype | lm_head_dtype | kl median (nats/token) | kl max | sqrt(2 kl) (~RMS dlogprob, nats) "
        "| max abs dlogprob median / max (nats) | on-policy tokens | trainer compute median (s/step) | step time "
        "median (s) "
        "| other processes (cores, max over runs) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, head, s in rows:
        lines.append(
            f"| {dtype} | {head} | {s['kl_median']:.2e} | {s['kl_max']:.2e} | {s['rms_lp_diff']:.2e} "
            f"| {s['lp_diff_max_median']:.2e} / {s['lp_diff_max']:.2e} | {s['onpolicy_share']:.0%} "
            f"| {s['compute_s_median']:.3f} | {s['step_time_s_median']:.3f} | "
            f"{s.get('other_cpu_cores_max', math.nan):.2f} |"
        )
    return "\n".join(lines)


def busctl_command(config: str, run_dir: Path, steps: int, dtype: str, head: str, overrides: list[str]) -> list[str]:
    """The `busctl up` command line of one setting (see the module docstring)."""
    return [
        sys.executable,
        "-m",
        "busctl",
        "up",
        "--overwrite",
        config,
        f"run_dir={run_dir}",
        f"trainer.max_steps={steps}",
        "max_async_level=0",
        "eval.enabled=false",
        f"trainer.dtype={dtype}",
        f"trainer.lm_head_dtype={head}",
        *overrides,
    ]


def host_busy_cpu_s() -> float:
    """CPU seconds the whole host has spent busy since boot (all cores; `/proc/stat`'s first line:
    user + nice + system + irq + softirq + steal ticks / SC_CLK_TCK); NaN where there is no /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return math.nan
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for descendants (`RUSAGE_CHILDREN`)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_setting(cmd: list[str], log: Path, timeout_s: float) -> tuple[float, float]:
    """Run one `busctl up` to the end with its output in `log`.

    Returns:
        `(wall_s, other_cpu_cores)`: its wall time, seconds, and the cores other processes of the
        host kept busy meanwhile (module docstring; NaN off Linux).

    Raises:
        RuntimeError: it exited non-zero or ran past `timeout_s` (its process group is then killed).
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    log.parent.mkdir(parents=True, exist_ok=True)
    host0, own0 = host_busy_cpu_s(), children_cpu_s()
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"busctl up ran past {timeout_s:.0f} s and was killed; see {log}") from None
    wall_s = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"busctl up exited with status {proc.returncode}; see {log}")
    other_cpu_s = (host_busy_cpu_s() - host0) - (children_cpu_s() - own0)
    return wall_s, max(other_cpu_s, 0.0) / wall_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.head_precision", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(REPO_ROOT / "configs" / "reverse_text.yaml"), help="the job's config")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (trainer.max_steps)")
    ap.add_argument("--rounds", type=int, default=1, help="runs per setting, the settings interleaved")
    ap.add_argument(
        "--setting",
        action="append",
        default=None,
        metavar="DTYPE/HEAD",
        help=f"trainer.dtype/trainer.lm_head_dtype to run (repeatable; default: {' '.join(DEFAULT_SETTINGS)})",
    )
    ap.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="extra busctl override for every run"
    )
    ap.add_argument("--out-dir", default=None, help="run directories, logs and results.json (default: a new temp dir)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="seconds before a run is killed")
    ns = ap.parse_args(argv)
    if ns.steps < 1 or ns.rounds < 1:
        ap.error("--steps and --rounds must be >= 1")
    try:
        settings = [parse_setting(s) for s in (ns.setting or DEFAULT_SETTINGS)]
    except ValueError as e:
        ap.error(str(e))
    out_dir = Path(ns.out_dir) if ns.out_dir else Path(tempfile.mkdtemp(prefix="head_precision-"))
    out_dir.mkdir(parents=True, exist_ok=True)

    steps: dict[tuple[str, str], list[dict[str, Any]]] = {setting: [] for setting in settings}
    runs: list[dict[str, Any]] = []
    for r in range(ns.rounds):
        for dtype, head in settings:
            name = f"{dtype}-{head}"
            run_dir = out_dir / name / f"round{r}"
            cmd = busctl_command(ns.config, run_dir, ns.steps, dtype, head, ns.override)
            print(f"[head_precision] round {r} {name}: {' '.join(cmd[1:])}", flush=True)
            wall_s, other_cores = run_setting(cmd, out_dir / name / f"round{r}.log", ns.timeout_s)
            records = step_records(run_dir / "metrics.jsonl")
            steps[(dtype, head)].extend(records)
            summary = summarize(records)
            print(
                f"[head_precision] round {r} {name}: {wall_s:.0f} s, other processes {other_cores:.2f} cores, "
                f"kl median {summary['kl_median']:.2e}, compute median {summary['compute_s_median']:.3f} s",
                flush=True,
            )
            runs.append(
                {
                    "round": r,
                    "trainer_dtype": dtype,
                    "lm_head_dtype": head,
                    "wall_s": wall_s,
                    "other_cpu_cores": other_cores,
                    "command": cmd[1:],
                    **summary,
                }
            )
    rows = []
    for (dtype, head), records in steps.items():
        other = [
            run["other_cpu_cores"] for run in runs if (run["trainer_dtype"], run["lm_head_dtype"]) == (dtype, head)
        ]
        rows.append((dtype, head, {**summarize(records), "other_cpu_cores_max": max(other)}))

    (out_dir / "results.json").write_text(
        json.dumps(
            {
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "date": time.strftime("%Y-%m-%d"),
                "steps": ns.steps,
                "rounds": ns.rounds,
                "settings": [{"trainer_dtype": d, "lm_head_dtype": h, **x} for d, h, x in rows],
                "runs": runs,
            },
            indent=2,
        )
    )
    print(markdown_table(rows))
    print(f"\n[head_precision] runs, logs and results.json in {out_dir}")
    return 0


if __name__ == "__main__":  # vLLM spawns processes: nothing runs on import
    sys.exit(main())
