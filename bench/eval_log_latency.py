"""How soon an eval result reaches metrics.jsonl while the trainer is busy, and what the eval-log
thread costs the trainer (trainer/observability/eval_log.py, issue 29 point 3).

Real ZeroMQ: a publisher process (as the packer and the hub are) binds an XPUB as the hub's and
sends ``--results`` eval results, one every ``--interval-s``, amid ``--flood-per-s`` other control
messages per second; the trainer's SUB is owned by :class:`EvalLog`'s thread. The main thread plays
a trainer that never waits for data: back-to-back CPU matmul "steps" (torch, ``--threads`` threads).

Prints, per phase:
- latency of each eval result from its publication to its record in metrics.jsonl (p50 / p99 / max,
  ms; wall clocks of the two processes, one host);
- the trainer's step time (median of the matmul steps) alone, with the publisher process running
  and no eval-log thread, and with the thread draining it: the last two differ by the thread's cost.

    python -m bench.eval_log_latency [--results 40] [--interval-s 0.1] [--flood-per-s 2000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import zmq

from bus.messages import EvalResult, TrainerStep, new_id
from bus.sockets import BusSocket
from bus.topics import Endpoints
from trainer.observability.eval_log import EvalLog
from trainer.observability.metrics_file import MetricsFile


def busy_steps(stop: threading.Event, n: int, size: int) -> list[float]:
    """``n`` (or until ``stop``) matmul "steps" of ``size`` x ``size`` float32; their seconds."""
    a0, b = torch.randn(size, size) / size**0.5, torch.randn(size, size) / size**0.5
    times = []
    for _ in range(n):
        if stop.is_set():
            break
        t0 = time.perf_counter()
        a = a0
        for _ in range(4):
            a = torch.tanh(a @ b)
        times.append(time.perf_counter() - t0)
    return times


class TimedMetricsFile(MetricsFile):
    """The bench's instrument: a :class:`MetricsFile` that notes when each record was appended."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.appended: dict[int, float] = {}

    def append(self, record: dict) -> None:
        super().append(record)
        self.appended[record["step"]] = time.time()


def publisher(address: str, results: int, interval_s: float, flood_per_s: float, ready, sent) -> None:
    """Another process, as the packer is: ``results`` eval results (their send times into ``sent``)
    amid ``flood_per_s`` other control messages per second; starts once ``ready`` is set."""
    ctx = zmq.Context()
    pub = BusSocket(ctx, "control_sub", "send", address, bind=True)
    ready.wait()
    every = 1.0 / flood_per_s if flood_per_s > 0 else float("inf")
    next_flood = time.perf_counter()
    for rnd in range(-50, results):  # rounds < 0: probes for the slow joiner, not measured
        if rnd >= 0:
            sent[rnd] = time.time()
        pub.send(
            EvalResult(
                id=new_id(),
                round=rnd,
                task="bench",
                version_min=0,
                version_max=0,
                num_samples=1,
                num_failed=0,
                metrics={"reward_mean": 0.5},
            )
        )
        until = time.perf_counter() + interval_s
        while (now := time.perf_counter()) < until:
            while now >= next_flood:
                pub.send(TrainerStep(id=new_id(), step=0, version=0, metrics={"loss": 0.0}))
                next_flood += every
            time.sleep(min(until - now, 0.001))
    time.sleep(0.5)
    pub.close()
    ctx.destroy(linger=0)


def phase(args, *, eval_log: bool, publish: bool) -> tuple[list[float], list[float]]:
    """Busy steps while (optionally) the publisher process runs and (optionally) EvalLog's thread
    drains the SUB; returns (step seconds, latencies in seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        endpoints = Endpoints("ipc", Path(tmp))
        endpoints.ensure_dirs()
        address = endpoints.address("control_sub")
        mp = multiprocessing.get_context("spawn")
        ready, sent = mp.Event(), mp.Manager().dict()
        proc = mp.Process(
            target=publisher, args=(address, args.results, args.interval_s, args.flood_per_s, ready, sent)
        )
        if publish:
            proc.start()
        ctx = zmq.Context()
        sub = BusSocket(ctx, "control_sub", "recv", address, bind=False)
        metrics = TimedMetricsFile(Path(tmp) / "metrics.jsonl")
        log = EvalLog(sub, metrics)
        if eval_log:
            log.start()
        time.sleep(0.5)  # the SUB connects
        ready.set()
        stop = threading.Event()
        if publish:
            threading.Thread(target=lambda: (proc.join(), stop.set()), daemon=True).start()
        steps = busy_steps(stop, 10**9 if publish else args.steps, args.size)
        log.close()
        sub.close()
        ctx.destroy(linger=0)
        latencies = [metrics.appended[r] - sent[r] for r in range(args.results) if r in metrics.appended and r in sent]
        return steps, latencies


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=int, default=40)
    ap.add_argument("--interval-s", type=float, default=0.1)
    ap.add_argument("--flood-per-s", type=float, default=2000.0)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--size", type=int, default=384)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    busy_steps(threading.Event(), 20, args.size)  # warm-up
    alone, _ = phase(args, eval_log=False, publish=False)
    traffic, drained, latencies = [], [], []
    for _ in range(2):  # alternated: the host's load drifts
        traffic += phase(args, eval_log=False, publish=True)[0]  # the publisher's CPU, nobody reading the SUB
        steps, lat = phase(args, eval_log=True, publish=True)
        drained += steps
        latencies += lat
    ms = sorted(x * 1000 for x in latencies)
    p = lambda q: ms[min(len(ms) - 1, int(q * len(ms)))]
    print(
        f"eval results written: {len(ms)} of {2 * args.results}; publication -> metrics.jsonl: p50 {p(0.5):.2f} ms, "
        f"p99 {p(0.99):.2f} ms, max {ms[-1]:.2f} ms (other control traffic {args.flood_per_s:.0f} msgs/s; "
        f"the trainer never waits)"
    )
    med = lambda xs: statistics.median(xs) * 1000
    print(
        f"trainer step (4 matmuls {args.size}^2, {args.threads} torch thread(s)), median: {med(alone):.2f} ms alone, "
        f"{med(traffic):.2f} ms with the publisher process and no eval-log thread, {med(drained):.2f} ms with the "
        f"eval-log thread draining it ({len(alone)}/{len(traffic)}/{len(drained)} steps)"
    )


if __name__ == "__main__":
    main()
