"""Soak: the default job under a random SIGKILL every 20-40 s and garbage at every endpoint.

Usage: ``python -m bench.soak [--minutes 30] [--config configs/reverse_text.yaml] [--run-dir DIR]
[--max-steps N] [--seed S] [--out FILE.json] [override ...]`` (not in CI: minutes of real vLLM).

What it does, on this host:

- starts ``busctl up CONFIG`` (fast failure detection: heartbeats 0.2 s, dead after 3 s, restart
  backoff 0.2-2 s, a restart budget that the soak cannot spend) with ``trainer.max_steps`` large
  meant to outlast ``--minutes`` (default: one step per 2 s of the soak, at least 60; killing stops
  early at 90% of them, so raise ``--max-steps`` on a fast host);
- every 20-40 s (uniform) SIGKILLs one component of a kind drawn uniformly from :data:`KINDS`:
  hub, prompt source, trainer, producer, reward worker, and the packer when the supervisor
  restarts it (``"packer"`` in ``RESTARTABLE_ROLES``; otherwise its kill would end the run, so it
  is left out and the JSON says so);
- all along, sends bursts of hostile frames (``tests/bus/fuzz.py``, the generators of
  ``tests/e2e/test_fuzz_run.py``) to every ROUTER the run binds on the data topics and to the hub;
- after ``--minutes`` (or 90% of the steps) stops killing and lets the run finish, then reads the
  run's own records.

Figures (printed and written as JSON): kills per kind, restarts per component, prompts issued and
their outcomes, samples trained, lost (issued prompts left without outcome, and ledger ``trained``
groups missing from ``trained_samples.jsonl``), trained twice (sample ids in more than one step of
the surviving lineage), and per kill kind the step-time cost of the restart: the gap between the
last trainer step before the kill and the first step beyond every step reached before it, minus
the median step interval (polled every :data:`POLL_S` s, so +-0.25 s); kills that come before the
run recovered from the previous one are listed but not costed (see :func:`restart_costs`).
"""

from __future__ import annotations

import argparse
import importlib.util
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

import zmq

from bus.messages import GroupsDropped, GroupsTrained, Prompt, RolloutGroup, ScoredGroup
from bus.topics import Endpoints
from busctl.component_table import RESTARTABLE_ROLES
from tests.e2e.test_faults import FAST_FAILURE_DETECTION, components, trained_steps

KINDS = ["hub", "prompt-source", "trainer", "producer", "rewards"] + (["packer"] if "packer" in RESTARTABLE_ROLES else [])
"""Component kinds (roles) the soak kills."""
POLL_S = 0.25
"""How often the soak reads the trainer's progress, seconds."""
BURST = 50
"""Hostile frame sets sent to each endpoint per second."""


def load_fuzz():
    """``tests/bus/fuzz.py`` as module ``fuzz`` (it is not a package module)."""
    if "fuzz" not in sys.modules:
        spec = importlib.util.spec_from_file_location("fuzz", Path(__file__).resolve().parents[1] / "tests" / "bus" / "fuzz.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["fuzz"] = module
        spec.loader.exec_module(module)
    return sys.modules["fuzz"]


class Garbage(threading.Thread):
    """Sends :data:`BURST` hostile frame sets per second to each data ROUTER and to the hub, until
    ``stop``; never blocks (NOBLOCK; what ZeroMQ cannot take now is skipped)."""

    def __init__(self, run_dir: Path, stop: threading.Event) -> None:
        super().__init__(daemon=True, name="garbage")
        fuzz = load_fuzz()
        endpoints = Endpoints("ipc", run_dir)
        targets = [  # (topic, socket type, generator): each message invalid for its receiver
            ("scored", zmq.DEALER, fuzz.HostileEnvelopes(101, "inbox", (ScoredGroup,))),
            ("batches", zmq.DEALER, fuzz.HostileEnvelopes(103, "outbox", (ScoredGroup,))),
            ("prompts", zmq.DEALER, fuzz.HostileEnvelopes(104, "outbox", (Prompt,))),
            ("rollouts", zmq.DEALER, fuzz.HostileEnvelopes(105, "outbox", (RolloutGroup,))),
            ("outcomes", zmq.DEALER, fuzz.HostileEnvelopes(106, "inbox", (GroupsDropped, GroupsTrained))),
            ("control_pub", zmq.PUB, fuzz.HostileMessages(102, None)),
        ]
        self.ctx = zmq.Context()
        self.targets = []
        for topic, kind, gen in targets:
            sock = self.ctx.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.connect(endpoints.address(topic))
            self.targets.append((topic, sock, gen.take(2000)))
        self.stop, self.sent = stop, 0

    def run(self) -> None:
        i = 0
        while not self.stop.wait(1.0):
            for _, sock, frames in self.targets:
                for k in range(BURST):
                    try:
                        sock.send_multipart(frames[(i + k) % len(frames)], flags=zmq.NOBLOCK)
                        self.sent += 1
                    except zmq.Again:
                        break
            i += BURST
        for _, sock, _ in self.targets:
            sock.close(linger=0)
        self.ctx.term()


def victim(run_dir: Path, kind: str, rng: random.Random) -> tuple[str, int] | None:
    """A live component of role ``kind`` (name, pid), drawn at random; None if none is up."""
    live = [(n, c["pid"]) for n, c in components(run_dir).items()
            if (n == kind or n.rsplit("-", 1)[0] == kind) and c.get("state") in ("ready", "running") and c.get("pid")]
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
    return {"median_step_interval_s": median,
            "cost_s": {kind: {"n": len(c), "median": statistics.median(c), "max": max(c)} for kind, c in costs.items()},
            "kill_log": [{key: k[key] for key in ("kind", "name", "step", "cost_s", "overlapped")} for k in kills]}


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
    return {"prompts_issued": acc["issued"], "outcomes": acc["outcomes"], "steps_trained": len(trained),
            "samples_trained": len(sample_ids), "samples_trained_twice": len(sample_ids) - len(set(sample_ids)),
            "prompts_lost": len(acc["unresolved"]) + len(ledger_trained - groups), "conflicts": len(acc["conflicts"])}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--config", default="configs/reverse_text.yaml")
    ap.add_argument("--run-dir", default="runs/soak", help="the soak run's directory; a previous soak there is replaced (busctl up --overwrite)")
    ap.add_argument("--max-steps", type=int, default=0, help="0: max(60, one per 2 s of the soak)")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--out", default="", help="JSON file (default: RUN_DIR/soak.json)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir).resolve()
    max_steps = args.max_steps or max(60, int(args.minutes * 30))
    rng = random.Random(args.seed)
    cmd = [sys.executable, "-m", "busctl", "up", "--overwrite", args.config, f"run_dir={run_dir}", f"trainer.max_steps={max_steps}",
           *FAST_FAILURE_DETECTION, "supervisor.max_restarts=1000", *args.overrides]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True).start()
    stop = threading.Event()
    kills: list[dict] = []
    progress: list[tuple[float, int]] = []
    try:
        while trained_steps(run_dir) < 1:
            if proc.poll() is not None:
                raise SystemExit("the run ended before its first step:\n" + "".join(output[-50:]))
            time.sleep(POLL_S)
        garbage = Garbage(run_dir, stop)
        garbage.start()
        deadline = time.monotonic() + args.minutes * 60
        next_kill = time.monotonic() + rng.uniform(20, 40)
        while time.monotonic() < deadline and proc.poll() is None:
            steps = trained_steps(run_dir)
            progress.append((time.monotonic(), steps))
            if steps >= 0.9 * max_steps:
                break
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
        "minutes_killing": args.minutes, "wall_s": round(time.monotonic() - started, 1), "max_steps": max_steps,
        "exit_code": proc.returncode, "kinds": KINDS, "packer_killed": "packer" in KINDS,
        "kills": {kind: sum(1 for k in kills if k["kind"] == kind) for kind in KINDS},
        "restarts": {name: c.get("restarts", 0) for name, c in status.items()},
        "garbage_frames_sent": garbage.sent if "garbage" in locals() else 0,
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
