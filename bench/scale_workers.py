"""One process of simulated workers for the scale simulation: ``python -m bench.scale_workers``.

``--role producers|rewards|trainer --count N``: N simulated workers of one kind
(:mod:`bench.scale_sim`) as threads of this process, each with its own courier and control sockets
on one shared zmq context (so the bus sees N peers; threads, not processes, because this 2-core
host cannot hold 128 Python processes, see bench/README.md). The load comes from
``RUN_DIR/sim_spec.json`` (the fields of :class:`bench.scale_sim.SimSpec` plus ``max_steps`` and
``num_producers``). The process ends once every worker stopped (``run.done``, or SIGTERM), and
writes its events to ``RUN_DIR/sim/<role>-<first>.json``: ``{"hops": [[event, id, t], ...],
"fanout": [[step, delay_s], ...], "duplicates": n}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path

import zmq

from bench.scale_sim import ControlProbe, SimProducer, SimReward, SimSpec, SimTrainer, SimWorker
from bus.topics import Endpoints
from configs.schema import load_config

log = logging.getLogger(__name__)

MAX_SOCKETS = 65_536
"""zmq sockets one process's context may hold (64 reward workers x 64 rollouts DEALERs and more)."""


def build_workers(
    role: str, count: int, first: int, run_dir: Path, stop: threading.Event, probe: ControlProbe
) -> list[SimWorker]:
    """The ``count`` workers of ``role``, indexes ``first..first+count-1``, their control read by ``probe``.

    Raises:
        ValueError: unknown role or a count < 1.
    """
    if role not in ("producers", "rewards", "trainer") or count < 1:
        raise ValueError(f"role must be producers|rewards|trainer and count >= 1, got {role!r} x {count}")
    cfg = load_config(run_dir / "config.yaml")
    raw = json.loads((run_dir / "sim_spec.json").read_text())
    max_steps, num_producers = raw.pop("max_steps"), raw.pop("num_producers")
    spec = SimSpec(**raw)
    ctx = zmq.Context(io_threads=1)
    ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
    endpoints = Endpoints(cfg.bus.transport, run_dir, cfg.bus.host, cfg.bus.base_port)
    timing = (cfg.bus.heartbeat_s, cfg.bus.dead_after_s, cfg.bus.ack_timeout_s)
    common = dict(spec=spec, bus_timing=timing, stop=stop, probe=probe, max_inflight_bytes=cfg.bus.max_inflight_bytes)
    workers: list[SimWorker] = []
    for i in range(first, first + count):
        if role == "producers":
            workers.append(SimProducer(ctx, endpoints, f"producer-{i}", index=i, **common))
        elif role == "rewards":
            workers.append(SimReward(ctx, endpoints, f"rewards-{i}", num_producers=num_producers, **common))
        else:
            workers.append(SimTrainer(ctx, endpoints, "trainer", max_steps=max_steps, **common))
    return workers


def main(argv: list[str] | None = None) -> int:
    """Run the workers until they stop; write their events. Returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--role", required=True)
    parser.add_argument("--count", type=int, default=1)
    parser.add_argument("--first", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format=f"%(asctime)s sim-{args.role} %(levelname)s %(name)s: %(message)s",
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    probe = ControlProbe(stop)
    workers = build_workers(args.role, args.count, args.first, args.run_dir, stop, probe)
    probe.start()
    for w in workers:
        w.start()
    stop.wait()  # the first worker that ends (run.done) ends the process's part
    time.sleep(0.5)  # let the last control messages and acks go out
    stop.set()
    for w in workers:
        w.thread.join(timeout=5)
    probe.join()
    out = {
        "hops": [h for w in workers for h in w.events.hops],
        "fanout": probe.fanout,
        "duplicates": sum(getattr(w, "duplicates", 0) for w in workers),
    }
    for w in workers:
        w.close()
    (args.run_dir / "sim").mkdir(exist_ok=True)
    (args.run_dir / "sim" / f"{args.role}-{args.first}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
