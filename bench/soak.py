"""Soak: the default job under a random SIGKILL every 20-40 s and garbage at every endpoint.

Usage: ``python -m bench.soak [--minutes 30] [--config configs/reverse_text.yaml] [--run-dir DIR]
[--max-steps N] [--seed S] [--transport ipc|tcp] [--base-port P] [--out FILE.json] [override ...]``
(not in CI: minutes of real vLLM).

It runs ``busctl up`` with fast failure detection, SIGKILLs one component of a kind drawn from :data:`KINDS`
every 20-40 s, sends hostile frames to every endpoint (:mod:`bench.soak_garbage`; with ``--transport tcp``
also from plaintext sockets the handshake must refuse, and certificate-less ``/metrics`` probes that must go
unanswered), then stops killing and lets the run finish. It reports kills, frames, probes, rejects, restarts,
prompt outcomes, samples lost or trained twice, and per kill kind the step-time cost of the restart
(:func:`restart_costs`). Results: bench/README.md, "Every component kind killed: the nemesis and the soak".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.soak_garbage import Garbage, probe_metrics
from bus.topics import Endpoints
from configs.schema import load_config
from busctl.components.table import RESTARTABLE_ROLES
from tests.e2e.test_faults import FAST_FAILURE_DETECTION, components, trained_steps

KINDS = ["hub", "prompt-source", "trainer", "producer", "rewards"] + (
    ["packer"] if "packer" in RESTARTABLE_ROLES else []
)
"""Component kinds (roles) the soak kills."""
POLL_S = 0.25
"""How often the soak reads the trainer's progress, seconds."""
PROBE_S = 30.0
"""How often (tcp) the soak asks every component's metrics endpoint without a client certificate."""


def read_records(path: Path) -> list[dict]:
    """The JSON lines of ``path`` (a torn last line, written while the run was killed, skipped)."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def probe_all(run_dir: Path, probes: dict[str, int]) -> None:
    """Ask every live component's metrics endpoint without the client certificate
    (:func:`bench.soak_garbage.probe_metrics`); counts into ``probes`` ("asked", "answered")."""
    for c in components(run_dir).values():
        if c.get("metrics_port") and c.get("state") in ("ready", "running"):
            for answered in probe_metrics(c.get("metrics_host") or "127.0.0.1", int(c["metrics_port"])).values():
                probes["asked"] += 1
                probes["answered"] += int(answered)


def victim(run_dir: Path, kind: str, rng: random.Random) -> tuple[str, int] | None:
    """A live component of role ``kind`` (name, pid), drawn at random; None if none is up."""
    live = [
        (n, c["pid"])
        for n, c in components(run_dir).items()
        if (n == kind or n.rsplit("-", 1)[0] == kind) and c.get("state") in ("ready", "running") and c.get("pid")
    ]
    return rng.choice(live) if live else None


def restart_costs(kills: list[dict], progress: list[tuple[float, int]]) -> dict:
    """Per kill kind: the step-time cost of its restarts, seconds (see the module docstring).

    A kill that comes before the run recovered from the previous one (before the trainer passed
    every step reached before that kill) is *overlapped*: its cost is not separable from the
    previous one's, so it is listed (``cost_s`` None) but left out of the per-kind figures.

    Args:
        kills: ``{"kind", "name", "t", "step"}`` per kill (``t``: ``time.monotonic()``), in time
            order; each gets ``cost_s`` (float or None) and ``overlapped`` (bool) added.
        progress: ``(t, trained steps)`` samples, in time order.
    """
    new_max: list[tuple[float, int]] = []  # (t, step): times the run first reached each step
    for t, step in progress:
        if not new_max or step > new_max[-1][1]:
            new_max.append((t, step))
    gaps = [b[0] - a[0] for a, b in zip(new_max, new_max[1:])]
    median = statistics.median(gaps) if gaps else 0.0
    costs: dict[str, list[float]] = {}
    recovered_at = float("-inf")
    for k in kills:
        before = [p for p in new_max if p[0] <= k["t"]]
        after = [p for p in new_max if p[0] > k["t"]]
        k["overlapped"] = k["t"] < recovered_at
        k["cost_s"] = None
        if before and after:
            recovered_at = after[0][0]
            if not k["overlapped"]:
                k["cost_s"] = after[0][0] - before[-1][0] - median
                costs.setdefault(k["kind"], []).append(k["cost_s"])
        else:
            recovered_at = float("inf")
    return {
        "median_step_interval_s": median,
        "cost_s": {kind: {"n": len(c), "median": statistics.median(c), "max": max(c)} for kind, c in costs.items()},
        "kill_log": [{key: k[key] for key in ("kind", "name", "step", "cost_s", "overlapped")} for k in kills],
    }


def run_figures(run_dir: Path) -> dict:
    """Accounting of the finished run from its records: issued, outcomes, trained, lost, twice."""
    acc = json.loads((run_dir / "accounting.json").read_text())
    trained = [json.loads(line) for line in (run_dir / "trained_samples.jsonl").read_text().splitlines() if line]
    sample_ids = [sid for r in trained for sid in r["sample_ids"]]
    groups = {sid.partition("/")[0] for sid in sample_ids}
    ledger_trained = set()
    for line in (run_dir / "ledger.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("outcome") == "trained":
            ledger_trained.update(rec.get("ids", [rec.get("id")]))
    ledger_trained.discard(None)
    rejected = 0.0  # every component's last metrics (metrics_final/), restarted ones since their restart
    for prom in sorted((run_dir / "metrics_final").glob("*.prom")):
        for family in text_string_to_metric_families(prom.read_text()):
            rejected += sum(s.value for s in family.samples if s.name == "rlbus_bus_rejected_total")
    eval_rounds = sorted(
        {r["step"] for r in read_records(run_dir / "eval.jsonl") if any(k.startswith("eval/") for k in r)}
    )
    return {
        "eval_rounds_reported": eval_rounds,
        "frames_rejected_final": int(rejected),
        "prompts_issued": acc["issued"],
        "outcomes": acc["outcomes"],
        "steps_trained": len(trained),
        "samples_trained": len(sample_ids),
        "samples_trained_twice": len(sample_ids) - len(set(sample_ids)),
        "prompts_lost": len(acc["unresolved"]) + len(ledger_trained - groups),
        "conflicts": len(acc["conflicts"]),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--config", default="configs/reverse_text.yaml")
    ap.add_argument(
        "--run-dir",
        default="runs/soak",
        help="the soak run's directory; a previous soak there is replaced (busctl up --overwrite)",
    )
    ap.add_argument("--max-steps", type=int, default=0, help="0: max(60, one per 2 s of the soak)")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument(
        "--transport",
        choices=("ipc", "tcp"),
        default="ipc",
        help="tcp: bus.transport=tcp with CurveZMQ keys (and metrics TLS) made by busctl keys beside RUN_DIR",
    )
    ap.add_argument("--base-port", type=int, default=6550, help="bus.base_port with --transport tcp")
    ap.add_argument("--out", default="", help="JSON file (default: RUN_DIR/soak.json)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    max_steps = args.max_steps or max(60, int(args.minutes * 30))
    rng = random.Random(args.seed)
    keys_dir = None
    transport = []
    if args.transport == "tcp":
        keys_dir = run_dir.with_name(run_dir.name + "-keys")
        if not (keys_dir / "tls").is_dir():
            subprocess.run([sys.executable, "-m", "busctl", "keys", str(keys_dir)], check=True)
        transport = ["bus.transport=tcp", f"bus.curve_keys_dir={keys_dir}", f"bus.base_port={args.base_port}"]
    cmd = [
        sys.executable,
        "-m",
        "busctl",
        "up",
        "--overwrite",
        args.config,
        f"run_dir={run_dir}",
        f"trainer.max_steps={max_steps}",
        *FAST_FAILURE_DETECTION,
        "supervisor.max_restarts=1000",
        *transport,
        *args.overrides,
    ]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    stop = threading.Event()
    kills: list[dict] = []
    progress: list[tuple[float, int]] = []
    probes = {"asked": 0, "answered": 0}
    try:
        while trained_steps(run_dir) < 1:
            if proc.poll() is not None:
                raise SystemExit("the run ended before its first step:\n" + "".join(output[-50:]))
            time.sleep(POLL_S)
        cfg = load_config(run_dir / "config.yaml")
        endpoints = Endpoints(cfg.bus.transport, run_dir, cfg.bus.host, cfg.bus.base_port, dict(cfg.bus.hosts))
        garbage = Garbage(endpoints, keys_dir, cfg.producers.max_replicas, stop)
        garbage.start()
        next_probe = time.monotonic()
        deadline = time.monotonic() + args.minutes * 60
        next_kill = time.monotonic() + rng.uniform(20, 40)
        while time.monotonic() < deadline and proc.poll() is None:
            steps = trained_steps(run_dir)
            progress.append((time.monotonic(), steps))
            if steps >= 0.9 * max_steps:
                break
            if keys_dir is not None and time.monotonic() >= next_probe:
                probe_all(run_dir, probes)
                next_probe = time.monotonic() + PROBE_S
            if time.monotonic() >= next_kill:
                kind = rng.choice(KINDS)
                picked = victim(run_dir, kind, rng)
                if picked is not None:
                    os.kill(picked[1], signal.SIGKILL)
                    kills.append({"kind": kind, "name": picked[0], "t": time.monotonic(), "step": steps})
                    print(f"[{time.monotonic() - started:7.1f} s] step {steps}: SIGKILL {picked[0]}", flush=True)
                next_kill = time.monotonic() + rng.uniform(20, 40)
            time.sleep(POLL_S)
        stop.set()
        while proc.poll() is None:  # the run finishes its steps
            progress.append((time.monotonic(), trained_steps(run_dir)))
            time.sleep(POLL_S)
    finally:
        stop.set()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    status = components(run_dir)
    result = {
        "minutes_killing": args.minutes,
        "wall_s": round(time.monotonic() - started, 1),
        "max_steps": max_steps,
        "exit_code": proc.returncode,
        "kinds": KINDS,
        "packer_killed": "packer" in KINDS,
        "kills": {kind: sum(1 for k in kills if k["kind"] == kind) for kind in KINDS},
        "restarts": {name: c.get("restarts", 0) for name, c in status.items()},
        "transport": args.transport,
        "curve": keys_dir is not None,
        "garbage_frames_sent": garbage.sent if "garbage" in locals() else {},
        "metrics_probes_without_certificate": probes,
        **restart_costs(kills, progress),
    }
    if proc.returncode == 0:
        result.update(run_figures(run_dir))
    else:
        result["output_tail"] = "".join(output[-40:])
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out or run_dir / "soak.json").write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
