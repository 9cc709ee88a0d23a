"""Summary of one scale-simulation point (:func:`summarize`): throughput and latency per hop,
fan-out, memory, CPU, accounting and the first bottleneck.

Inputs: the raw measurements of :func:`bench.scale_point.run_point`, the simulated workers' events
(``RUN_DIR/sim/*.json``, :mod:`bench.scale_workers`) and the prompt source's ``accounting.json``.

Hops and what their latency measures (wall-clock seconds, one host):

- ``rollouts``: producer's send of a group -> a reward worker's receipt (credit waits included);
- ``scored_to_step``: reward worker's send -> the trainer has the whole step of that group (the
  wait for the step to fill and for the trainer's credit included);
- ``packer``: the last group of a step sent by a reward worker -> the step's first micro-batch at
  the trainer (the packer's decision, spool fsyncs, packing and the ``batches`` hop).

The ``prompts`` hop has no latency: the real prompt source stamps no send time (its rate is given).
Throughput of a hop: events / (last - first event time) of the hop's receiving side, groups/s.

Bottleneck: the ideal rate is the smallest simulated capacity (producers ``N * tokens_per_s /
tokens_per_group``, reward workers ``M / score_s``, trainer ``prompts_per_step / step_s``); a run
reaching at least :data:`BOUND_SHARE` of it is bound by that simulated stage (by design), else by
the real pipeline, named by its busiest process (CPU seconds per second of wall time).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bench.scale_sim import SimSpec

BOUND_SHARE = 0.7
"""Achieved / ideal rate above which the point is bound by a simulated stage."""


def _load_events(run_dir: Path) -> tuple[dict[str, dict[str, float]], list[float], int]:
    """(first time of each ``event -> id``, fan-out delays, duplicates trained) of a run."""
    first: dict[str, dict[str, float]] = {}
    fanout: list[float] = []
    duplicates = 0
    for path in sorted((run_dir / "sim").glob("*.json")):
        raw = json.loads(path.read_text())
        for event, ident, t in raw["hops"]:
            first.setdefault(event, {}).setdefault(ident, t)
        fanout.extend(delay for _, delay in raw["fanout"])
        duplicates += raw["duplicates"]
    return first, fanout, duplicates


def _rate(times: dict[str, float]) -> float:
    """Events per second between the first and the last one (0 for fewer than 2)."""
    if len(times) < 2:
        return 0.0
    ts = sorted(times.values())
    return (len(ts) - 1) / max(ts[-1] - ts[0], 1e-9)


def _pcts(values: list[float]) -> dict[str, float]:
    """p50 / p99 / max of ``values`` in milliseconds (NaN when empty)."""
    if not values:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "max_ms": float("nan")}
    a = np.asarray(values) * 1000.0
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max())}


def by_kind(per_process: dict[str, float]) -> dict[str, float]:
    """Sum the values of the simulated processes of one kind (``sim-rewards-0``, ``sim-rewards-1``
    -> ``sim-rewards``); real components and the trainer keep their own names."""
    out: dict[str, float] = {}
    for name, value in per_process.items():
        kind = name.rsplit("-", 1)[0] if name.startswith(("sim-producers-", "sim-rewards-")) else name
        out[kind] = out.get(kind, 0.0) + value
    return out


def capacities(spec: SimSpec, producers: int, rewards: int, prompts_per_step: int) -> dict[str, float]:
    """Simulated capacity of each stage, groups/s (see the module docstring)."""
    mean_tokens = min(spec.median_tokens * float(np.exp(spec.sigma**2 / 2)), spec.max_tokens)
    return {
        "producers": producers * spec.tokens_per_s / (mean_tokens * spec.group_size),
        "rewards": rewards / spec.score_s if spec.score_s else float("inf"),
        "trainer": prompts_per_step / spec.step_s if spec.step_s else float("inf"),
    }


def summarize(
    run_dir: Path,
    raw: dict,
    *,
    spec: SimSpec,
    producers: int,
    rewards: int,
    prompts_per_step: int,
    max_steps: int,
    message_bytes: int,
) -> dict:
    """The point's summary (a JSON-able dict; the keys are the columns of bench/README.md's table)."""
    first, fanout, duplicates = _load_events(run_dir)
    acc_path = run_dir / "accounting.json"
    acc = json.loads(acc_path.read_text()) if acc_path.is_file() else {"issued": 0, "outcomes": {}, "unresolved": ["?"]}
    sent, recv = first.get("rollout_sent", {}), first.get("rollout_recv", {})
    scored = first.get("scored_sent", {})
    step_groups: dict[str, list[str]] = {}
    to_step = []
    for key, t in first.get("batch_group", {}).items():
        step, gid = key.split("/", 1)
        step_groups.setdefault(step, []).append(gid)
        if gid in scored:
            to_step.append(t - scored[gid])
    packer = [
        first["batch_first"][s] - max(scored[g] for g in gids)
        for s, gids in step_groups.items()
        if s in first.get("batch_first", {}) and all(g in scored for g in gids)
    ]
    wall = raw["wall_s"]
    cpu_proc = {k: v / wall for k, v in raw["cpu_s"].items()}
    cpu = by_kind(cpu_proc)
    caps = capacities(spec, producers, rewards, prompts_per_step)
    ideal = min(caps.values())
    trained_groups = len(first.get("batch_group", {}))
    trained_rate = _rate(first.get("trained", {})) * prompts_per_step
    if trained_rate >= BOUND_SHARE * ideal:
        bottleneck = f"sim {min(caps, key=caps.get)} (by design)"
    else:
        busiest = max(cpu_proc, key=cpu_proc.get)
        bottleneck = f"real: {busiest} ({cpu_proc[busiest]:.2f} CPU)"
    outcomes = acc.get("outcomes", {})
    resolved = sum(outcomes.values())
    return {
        "producers": producers,
        "rewards": rewards,
        "message_bytes": message_bytes,
        "group_size": spec.group_size,
        "median_tokens": spec.median_tokens,
        "prompts_per_step": prompts_per_step,
        "max_steps": max_steps,
        "finished": raw["finished"],
        "wall_s": wall,
        "rate_groups_s": {
            "prompts": _rate(first.get("prompt_recv", {})),
            "rollouts": _rate(recv),
            "scored": _rate(scored),
            "trained": trained_rate,
        },
        "capacity_groups_s": caps,
        "ideal_groups_s": ideal,
        "latency": {
            "rollouts": _pcts([recv[i] - sent[i] for i in recv if i in sent]),
            "scored_to_step": _pcts(to_step),
            "packer": _pcts(packer),
        },
        "fanout": _pcts(fanout),
        "fanout_receipts": len(fanout),
        "rss_max_mib": {k: v / 2**20 for k, v in by_kind(raw["rss_max"]).items()},
        "rss_max_mib_per_process": max(raw["rss_max"].values(), default=0) / 2**20,
        "cpu_per_s": cpu,
        "cpu_per_s_busiest_process": cpu_proc.get(max(cpu_proc, key=cpu_proc.get, default=""), 0.0),
        "queues_max": raw["queues_max"],
        "queue_mib_max": {k: v / 2**20 for k, v in raw.get("queue_bytes_max", {}).items()},
        "accounting": {
            "issued": acc.get("issued", 0),
            "outcomes": outcomes,
            "unresolved": len(acc.get("unresolved", [])),
            "trained_groups_seen_by_trainer": trained_groups,
            "duplicates_trained": duplicates,
            "complete": raw["finished"]
            and resolved == acc.get("issued", -1)
            and not acc.get("unresolved")
            and duplicates == 0,
        },
        "bottleneck": bottleneck,
    }


def markdown_table(points: list[dict]) -> str:
    """The sweep table of bench/README.md: one row per point."""
    rows = [
        "| P x R | group bytes | trained g/s (ideal) | prompts / rollouts / scored g/s | rollouts p50/p99 ms "
        "| packer p50/p99 ms | fan-out p50/p99 ms | CPU cores: rewards / producers / packer / prompt-source / hub "
        "| peak RSS MiB: packer / prompt-source / hub | max queue: prompts outbox / packer scored inbox / batches "
        "outbox "
        "| accounting | first bottleneck |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        r, lat, c, m, q = p["rate_groups_s"], p["latency"], p["cpu_per_s"], p["rss_max_mib"], p["queues_max"]
        acc = p["accounting"]

        def qmax(prefix: str, q: dict = q) -> str:
            return f"{max((v for k, v in q.items() if k.startswith(prefix)), default=0):.0f}"

        rows.append(
            f"| {p['producers']}x{p['rewards']} | {p['message_bytes']:,} | {r['trained']:.1f} "
            f"({p['ideal_groups_s']:.1f}) "
            f"| {r['prompts']:.1f} / {r['rollouts']:.1f} / {r['scored']:.1f} "
            f"| {lat['rollouts']['p50_ms']:.1f} / {lat['rollouts']['p99_ms']:.0f} | {lat['packer']['p50_ms']:.0f} / "
            f"{lat['packer']['p99_ms']:.0f} "
            f"| {p['fanout']['p50_ms']:.1f} / {p['fanout']['p99_ms']:.0f} "
            f"| {c.get('sim-rewards', 0):.2f} / {c.get('sim-producers', 0):.2f} / {c.get('packer', 0):.2f} / "
            f"{c.get('prompt-source', 0):.2f} / {c.get('hub', 0):.2f} "
            f"| {m.get('packer', 0):.0f} / {m.get('prompt-source', 0):.0f} / {m.get('hub', 0):.0f} "
            f"| {qmax('prompt-source:prompts/')} / {qmax('packer:scored/')} / {qmax('packer:batches/')} "
            f"| {acc['issued']} issued, {acc['outcomes'].get('trained', 0)} trained, {acc['unresolved']} open, "
            f"{acc['duplicates_trained']} twice{'' if acc['complete'] else ' INCOMPLETE'} | {p['bottleneck']} |"
        )
    return "\n".join(rows)
