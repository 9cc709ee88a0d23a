"""Per-stage throughput of a finished run, as a markdown table for ``bench/README.md``.

Usage: ``python -m bench.pipeline_report RUN_DIR``

Reads ``metrics.jsonl`` (trainer steps), ``eval.jsonl`` (eval rounds) and ``metrics_final/*.prom`` (every
component's Prometheus metrics, saved by ``busctl up`` at the end of the run). Step times are medians
over the run's steps (the first step, which includes warm-up, is left out when there are more
than two); rates of the producers and reward workers are totals over the wall time of the
training steps.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def prom_totals(path: Path) -> dict[str, float]:
    """Sum of every sample by sample name (labels summed over) in one Prometheus text file."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def stage_totals(run_dir: Path, prefix: str) -> dict[str, float]:
    """Metric totals summed over every component whose name starts with ``prefix``."""
    totals: dict[str, float] = {}
    for path in sorted((run_dir / "metrics_final").glob(f"{prefix}*.prom")):
        for name, value in prom_totals(path).items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


def mean_of(totals: dict[str, float], histogram: str) -> float:
    """The mean of a Prometheus histogram from its ``_sum`` and ``_count`` totals (0 without observations)."""
    return totals.get(f"{histogram}_sum", 0) / max(totals.get(f"{histogram}_count", 0), 1)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(run_dir: Path) -> str:
    """The markdown table of one run."""
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    records = read_jsonl(run_dir / "eval.jsonl") if (run_dir / "eval.jsonl").is_file() else []
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and k.endswith("/reward_mean")})
    steady = steps[1:] if len(steps) > 2 else steps
    wall_s = sum(r["step_time_s"] for r in steps)
    med = lambda key: statistics.median(r[key] for r in steady)
    prod = stage_totals(run_dir, "producer")
    rew = stage_totals(run_dir, "rewards")
    gen_tokens = prod.get("rlbus_producer_completion_tokens_total", 0.0)
    rows = [
        ("steps", f"{len(steps)}"),
        ("wall time of the training steps", f"{wall_s:.1f} s"),
        ("step time (median)", f"{med('step_time_s'):.2f} s"),
        ("trainer: tokens/s over wall time (median)", f"{med('tokens_per_s'):,.0f}"),
        (
            "trainer: tokens/s while computing (median)",
            f"{statistics.median(r['num_tokens'] / r['train_time_s'] for r in steady):,.0f}",
        ),
        ("trainer: weight send per step (median)", f"{med('weight_sync_s') * 1000:.0f} ms"),
        ("producers: completion tokens/s (total / wall)", f"{gen_tokens / wall_s:,.0f}"),
        (
            "producers: time per group (mean)",
            f"{mean_of(prod, 'rlbus_producer_group_seconds'):.2f} s",
        ),
        (
            "producers: weight update pause (mean)",
            f"{mean_of(prod, 'rlbus_producer_weight_update_seconds') * 1000:.0f} ms",
        ),
        ("reward workers: groups/s (total / wall)", f"{rew.get('rlbus_rewards_groups_total', 0) / wall_s:.1f}"),
        (
            "reward workers: time per group (mean)",
            f"{mean_of(rew, 'rlbus_rewards_score_seconds') * 1000:.1f} ms",
        ),
        (
            "policy lag mean / max",
            f"{statistics.mean(r['policy_lag_mean'] for r in steps):.2f} / "
            f"{max(r['policy_lag_max'] for r in steps):.0f}",
        ),
    ]
    for key in eval_keys:  # eval/<task>/reward_mean at each eval round (step = policy version)
        evals = [r for r in records if key in r]
        rows.append(
            (f"{key} step {evals[0]['step']} -> {evals[-1]['step']}", f"{evals[0][key]:.3f} -> {evals[-1][key]:.3f}")
        )
    return "| measure | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m bench.pipeline_report RUN_DIR")
    print(report(Path(sys.argv[1])))
