"""rlbus against TRL 1.16's ``GRPOTrainer`` on the same job, side by side (issue 14).

Usage (from the repository root; needs the ``bench`` extra: ``pip install -e '.[bench]'``)::

    python -m bench.vs_trl [--rounds 1] [--steps 300] [--eval-every 25] [--config configs/reverse_text.yaml]
        [--out bench/results/vs_trl-DATE.json] [--rlbus-override key=value ...]

It resolves the policy as ``busctl up`` does (both arms load the same cached directory), measures the fp32
matmul throughput for the machine floor, runs the arms alternately ``--rounds`` times (TRL in a subprocess,
:mod:`bench.trl_arm`; rlbus as ``busctl up``), each arm's clock starting just before its launch, and prints the
table (:func:`bench.vs_trl_stats.markdown_table`) with every number in ``--out``. rlbus's event times are when
this process first sees the record in ``metrics.jsonl`` or ``eval.jsonl`` (polled every 50 ms); with several
rounds each measure is the median. Results: bench/README.md, "rlbus vs TRL on the same job".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.vs_trl_stats import Event, floor_samples_per_s, markdown_table, matmul_gflops, step_flops, summarize_arm

REPO_ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.05


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config", default=str(REPO_ROOT / "configs" / "reverse_text.yaml"), help="rlbus config of the job"
    )
    ap.add_argument("--rounds", type=int, default=1, help="rounds of (TRL, rlbus); more rounds alternate the arms")
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per arm (default: the config's trainer.max_steps)"
    )
    ap.add_argument("--eval-every", type=int, default=25, help="eval every this many steps in both arms")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the TRL arm and of the matmul measurement")
    ap.add_argument("--steady-skip", type=float, default=0.1, help="fraction of the first steps left out of samples/s")
    ap.add_argument(
        "--rlbus-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra busctl override for the rlbus arm only (repeatable); the TRL arm ignores it",
    )
    ap.add_argument("--arm-timeout", type=float, default=3600.0, help="seconds before an arm is stopped")
    ap.add_argument("--work-dir", default=None, help="run directories and logs (default runs/vs_trl/STAMP)")
    ap.add_argument("--out", default=None, help="JSON results (default bench/results/vs_trl-STAMP.json)")
    ns = ap.parse_args(argv)
    if ns.rounds < 1 or (ns.steps is not None and ns.steps < 2) or ns.eval_every < 0 or ns.threads < 1:
        ap.error("need --rounds >= 1, --steps >= 2, --eval-every >= 0 and --threads >= 1")
    return ns


def resolve_policy(cfg: Any) -> Path:
    """The policy directory both arms load: ``model.path``, or the tiny policy ``busctl up`` would
    build or reuse (same function and parameters as ``busctl.supervisor.Supervisor.prepare``)."""
    if cfg.model.path:
        return Path(cfg.model.path).resolve()
    from policies.tiny_model import ensure_policy

    m = cfg.model
    cache = Path(m.cache_dir) if Path(m.cache_dir).is_absolute() else REPO_ROOT / m.cache_dir
    return Path(
        ensure_policy(cache, sft_steps=m.sft_steps, sft_target_loss=m.sft_target_loss, seed=cfg.trainer.seed)
    ).resolve()


def _env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def _wait(proc: subprocess.Popen, timeout: float, name: str, log: Path, on_poll: Any = None) -> None:
    """Wait for ``proc`` (calling ``on_poll()`` every ``POLL_S``); stop it after ``timeout`` s.

    Raises:
        RuntimeError: the arm timed out or exited non-zero (names its log).
    """
    deadline = time.time() + timeout
    while proc.poll() is None:
        if on_poll is not None:
            on_poll()
        if time.time() > deadline:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise RuntimeError(f"{name} arm ran past {timeout:.0f} s and was stopped; see {log}")
        time.sleep(POLL_S)
    if on_poll is not None:
        on_poll()
    if proc.returncode != 0:
        raise RuntimeError(f"{name} arm exited with status {proc.returncode}; see {log}")


def run_trl(ns: argparse.Namespace, policy: Path, steps: int, work: Path) -> tuple[float, list[Event]]:
    """One TRL arm; returns ``(launch epoch s, events)``."""
    work.mkdir(parents=True)
    events_path, log = work / "events.jsonl", work / "trl.log"
    cmd = [
        sys.executable,
        "-m",
        "bench.trl_arm",
        "--config",
        ns.config,
        "--policy",
        str(policy),
        "--events",
        str(events_path),
        "--out-dir",
        str(work / "trl_output"),
        "--steps",
        str(steps),
        "--eval-every",
        str(ns.eval_every),
        "--threads",
        str(ns.threads),
    ]
    with open(log, "wb") as out:
        launch = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(ns.threads), stdout=out, stderr=subprocess.STDOUT)
        _wait(proc, ns.arm_timeout, "TRL", log)
    return launch, [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]


class MetricsTail:
    """Turns new lines of an rlbus run's ``metrics.jsonl`` or ``eval.jsonl`` into events, stamped when first seen."""

    def __init__(self, path: Path, eval_task: str) -> None:
        self.path, self.key, self.offset = path, f"eval/{eval_task}/reward_mean", 0
        self.pending, self.events = b"", []

    def poll(self) -> None:
        """Read what was appended since the last poll (complete lines only)."""
        if not self.path.is_file():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        now = time.time()
        self.offset += len(chunk)
        lines = (self.pending + chunk).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            if line.strip():
                self.events.extend(metrics_events(json.loads(line), now, self.key))


def metrics_events(record: dict, t: float, eval_key: str) -> list[Event]:
    """The events of one ``metrics.jsonl`` / ``eval.jsonl`` record seen at ``t``: a training record (``loss`` present)
    is a step with ``num_tokens`` and ``num_loss_tokens`` (completion tokens); a record with
    ``eval_key`` an eval; anything else none."""
    out: list[Event] = []
    if "loss" in record:
        out.append(
            {
                "t": t,
                "kind": "step",
                "step": int(record["step"]),
                "num_tokens": record.get("num_tokens"),
                "completion_tokens": record.get("num_loss_tokens"),
            }
        )
    if eval_key in record:
        out.append({"t": t, "kind": "eval", "step": int(record["step"]), "reward_mean": float(record[eval_key])})
    return out


def run_rlbus(ns: argparse.Namespace, eval_task: str, steps: int, work: Path) -> tuple[float, list[Event]]:
    """One rlbus arm (``busctl up`` with a fresh run_dir); returns ``(launch epoch s, events)``."""
    work.mkdir(parents=True)
    run_dir, log = work / "run", work / "busctl.log"
    cmd = [
        sys.executable,
        "-m",
        "busctl",
        "up",
        ns.config,
        f"trainer.max_steps={steps}",
        f"eval.interval={ns.eval_every}",
        f"run_dir={run_dir}",
        *ns.rlbus_override,
    ]
    tails = [MetricsTail(run_dir / name, eval_task) for name in ("metrics.jsonl", "eval.jsonl")]
    with open(log, "wb") as out:
        launch = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(None), stdout=out, stderr=subprocess.STDOUT)
        _wait(proc, ns.arm_timeout, "rlbus", log, lambda: [tail.poll() for tail in tails])
    return launch, sorted((e for tail in tails for e in tail.events), key=lambda e: e["t"])


def _median(values: list[Any]) -> Any:
    vals = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(vals) if len(vals) == len(values) and vals else None


def aggregate(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over rounds of every numeric measure (None if any round lacks it)."""
    keys = [k for k, v in summaries[0].items() if isinstance(v, (int, float)) or v is None]
    return {k: _median([s[k] for s in summaries]) for k in keys}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); returns the exit status."""
    ns = _args(argv)
    sys.path.insert(0, str(REPO_ROOT))
    from configs.schema import load_config
    from tasks.registry import eval_tasks

    cfg = load_config(ns.config)  # the job; the TRL arm reads the same file
    rlbus_cfg = load_config(ns.config, ns.rlbus_override)
    steps = ns.steps or cfg.trainer.max_steps
    batches = {"trl": cfg.trainer.batch_size, "rlbus": rlbus_cfg.trainer.batch_size}
    batch = batches["rlbus"]
    eval_task = eval_tasks(cfg)[0].name
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    work = Path(ns.work_dir or REPO_ROOT / "runs" / "vs_trl" / stamp).resolve()
    out = Path(ns.out or REPO_ROOT / "bench" / "results" / f"vs_trl-{stamp}.json")
    policy = resolve_policy(cfg)
    import torch
    from transformers import AutoModelForCausalLM

    num_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(policy).parameters())
    mm = matmul_gflops(ns.threads)
    if batches["trl"] != batch:
        print(f"warning: --rlbus-override changes the batch ({batches['trl']} for TRL, {batch} for rlbus)", flush=True)
    print(
        f"policy {policy} ({num_params:,} parameters); fp32 matmul {mm['gflops']:.1f} GFLOP/s at {ns.threads} threads; "
        f"{steps} steps x {batch} samples, eval every {ns.eval_every}; work dir {work}",
        flush=True,
    )
    rounds: list[dict[str, Any]] = []
    for r in range(ns.rounds):
        for arm, runner in (
            ("trl", lambda w: run_trl(ns, policy, steps, w)),
            ("rlbus", lambda w: run_rlbus(ns, eval_task, steps, w)),
        ):
            print(f"round {r + 1}/{ns.rounds}: {arm} ...", flush=True)
            launch, events = runner(work / f"round{r + 1}-{arm}")
            events = [e for e in events if e["kind"] == "step" or e.get("task", eval_task) == eval_task]
            summary = summarize_arm(events, launch, batches[arm], steady_skip=ns.steady_skip)
            print(
                f"  {arm}: {summary['samples_per_s']:.1f} samples/s, first step {summary['first_step_s']}, "
                f"eval {summary['eval_step0']} -> {summary['eval_final']}",
                flush=True,
            )
            rounds.append({"round": r + 1, "arm": arm, "launch_t": launch, "summary": summary, "events": events})
    agg = {arm: aggregate([x["summary"] for x in rounds if x["arm"] == arm]) for arm in ("trl", "rlbus")}
    # generation runs the policy over every prompt token (prefill) and every completion token once
    t_train = t_gen = agg["rlbus"]["mean_tokens_per_step"]
    flops = step_flops(num_params, t_train, t_gen)
    floor = {
        "gflops": mm["gflops"],
        "matmul": mm,
        "num_params": num_params,
        "train_tokens_per_step": t_train,
        "gen_tokens_per_step": t_gen,
        "flops_per_step": flops,
        "samples_per_s": floor_samples_per_s(batch, flops, mm["gflops"]),
    }
    table = markdown_table(agg["trl"], agg["rlbus"], floor)
    ratios = {
        k: (agg["rlbus"][k] / agg["trl"][k] if agg["rlbus"][k] is not None and agg["trl"][k] else None)
        for k in ("samples_per_s", "first_step_s", "eval_target_s", "eval_final")
    }
    ratios["samples_per_s_over_floor"] = agg["rlbus"]["samples_per_s"] / floor["samples_per_s"]
    import trl

    result = {
        "date": stamp,
        "argv": sys.argv,
        "config": ns.config,
        "steps": steps,
        "batch": batches,
        "eval_every": ns.eval_every,
        "steady_skip": ns.steady_skip,
        "rlbus_overrides": ns.rlbus_override,
        "policy": str(policy),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "trl": trl.__version__,
        },
        "floor": floor,
        "aggregate": agg,
        "ratios": ratios,
        "rounds": rounds,
        "table": table,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(
        f"\n{table}\n\nrlbus/TRL samples/s {ratios['samples_per_s']:.2f}, rlbus/floor "
        f"{ratios['samples_per_s_over_floor']:.2f}; "
        f"results in {out}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
