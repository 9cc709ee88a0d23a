"""Per-message cost of a receiver's courier against its number of peers: ``python -m bench.scale_courier``.

The layout of a reward worker: one :class:`bus.courier.Courier` whose ``rollouts`` inbox connects
(one DEALER each) to N senders' ROUTERs (:func:`measure`); only one of them sends (``count``
small messages, taken and released at once by the receiver), the other N - 1 are connected and
heartbeating, as producers that have nothing to send. Measured: CPU seconds of the receiver's I/O
thread (``/proc/self/task/TID/stat``) per message, microseconds: flat in N when nothing on the
per-message path visits every peer or link; and the same thread's CPU share while nothing is sent
(the per-peer heartbeats). Real sockets (ipc://), real courier threads, one
process. Also the two other per-message costs that could grow with N: the sending side's choice of
peer (:func:`outbox_us`, the :class:`bus.outbox.Outbox` state machine with N receivers) and the
control hub's handling of ``weights.applied`` with N producers in its last-value cache
(:func:`hub_us`, a real hub thread, real sockets, its cache persisted to a file).
Results: bench/README.md, "Scale simulation".
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

import zmq

from bus.codec import encode
from bus.courier import Courier
from bus.hub import ControlHub
from bus.inbox import Inbox
from bus.messages import Prompt, WeightsApplied
from bus.outbox import Outbox
from bus.sockets import BusSocket

CLK_TCK = os.sysconf("SC_CLK_TCK")


def thread_cpu_s(native_id: int) -> float:
    """CPU seconds (user + system) of thread ``native_id`` of this process."""
    stat = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / CLK_TCK


def measure(num_peers: int, count: int = 3000, idle_s: float = 5.0) -> tuple[float, float]:
    """(receiver I/O-thread CPU per message, microseconds; its CPU share while idle for ``idle_s``
    seconds, heartbeats only, percent of a core) with ``num_peers`` connected senders.

    Raises:
        ValueError: ``num_peers`` or ``count`` < 1.
    """
    if num_peers < 1 or count < 1:
        raise ValueError(f"need num_peers >= 1 and count >= 1, got {num_peers}, {count}")
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 65_536)
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="rlbus-cm-") as d:
        eps = [f"ipc://{d}/r{i}" for i in range(num_peers)]
        senders = [Courier(ctx, stop=stop) for _ in range(num_peers)]
        outboxes = [c.sender("rollouts", ep, bind=True, capacity=64) for c, ep in zip(senders, eps)]
        receiver = Courier(ctx, stop=stop)
        inbox = receiver.receiver("rollouts", eps, bind=False, accept=(Prompt,), window=64)
        time.sleep(1.0 + num_peers / 100)  # every DEALER connected and greeted
        idle_before = thread_cpu_s(receiver._thread.native_id)
        time.sleep(idle_s)
        idle = (thread_cpu_s(receiver._thread.native_id) - idle_before) / idle_s

        def consume() -> None:
            for _ in range(count):
                msg = inbox.recv(timeout_s=30)
                if msg is None:
                    return
                inbox.done(msg.id)

        consumer = threading.Thread(target=consume)
        consumer.start()
        before = thread_cpu_s(receiver._thread.native_id)
        for i in range(count):
            outboxes[0].send(Prompt(id=f"m{i}", index=i, step=0, task="t", messages=[], info={}))
        consumer.join()
        used = thread_cpu_s(receiver._thread.native_id) - before
        stop.set()
        for c in [receiver, *senders]:
            c.close()
    ctx.term()
    return used / count * 1e6, idle * 100


def inbox_us(num_peers: int, count: int = 20_000) -> float:
    """Wall microseconds per message of the :class:`bus.inbox.Inbox` state machine alone (no
    socket, no thread: receive from peer 0, take, release, flush without heartbeat) with
    ``num_peers`` known senders: the per-message path's cost in the box, free of I/O noise."""
    box = Inbox("rollouts", (Prompt,), 64, session="bench")
    for n in range(num_peers):
        box.on_frames((0, b"p%d" % n), "H", "s%d" % n, None, [], 0.0)
    box.flush(0.0, True)
    frames = [encode(Prompt(id=f"m{i}", index=i, step=0, task="t", messages=[], info={})) for i in range(count)]
    started = time.perf_counter()
    for i in range(count):
        box.on_frames((0, b"p0"), "D", "s0", f"m{i}", frames[i], 1.0)
        box.done(box.recv(timeout_s=0).id)
        box.flush(1.0, False)
    return (time.perf_counter() - started) / count * 1e6


def outbox_us(num_peers: int, count: int = 20_000) -> float:
    """Wall microseconds per message of the :class:`bus.outbox.Outbox` state machine alone (no
    socket: send, dispatch to a peer, its taken + done ack) with ``num_peers`` receivers that each
    granted 64 messages of credit: the cost of choosing the peer, free of I/O noise."""
    box = Outbox("rollouts", 64, session="bench")
    sessions = {(0, b"r%d" % n): "s%d" % n for n in range(num_peers)}
    for key, session in sessions.items():
        box.on_frames(key, "A", session, [64, [], []], [], 0.0)
    msgs = [Prompt(id=f"m{i}", index=i, step=0, task="t", messages=[], info={}) for i in range(count)]
    started = time.perf_counter()
    for msg in msgs:
        box.send(msg, timeout_s=0)
        for send in box.dispatch(1.0):
            box.on_frames(send.key, "A", sessions[send.key], [64, [send.msg_id], [send.msg_id]], [], 1.0)
    return (time.perf_counter() - started) / count * 1e6


def hub_us(num_producers: int, count: int = 10_000) -> float:
    """CPU microseconds of a :class:`bus.hub.ControlHub` thread per ``weights.applied`` (forward
    + last-value cache update + persistence, no subscriber) with ``num_producers`` producers in
    its cache, each message from the next producer in turn. Real ipc:// sockets, cache file in a
    temporary run dir."""
    ctx = zmq.Context()
    stop = threading.Event()
    with tempfile.TemporaryDirectory(prefix="rlbus-hub-") as d:
        hub = ControlHub(ctx, f"ipc://{d}/pub", f"ipc://{d}/sub", stop, cache_path=Path(d) / "cache.bin")
        thread = threading.Thread(target=hub.run, name="hub")
        thread.start()
        pub = BusSocket(ctx, "control_pub", "send", f"ipc://{d}/pub", bind=False, stop=stop)

        def announce(first: int, n: int, version: int, timeout_s: float = 60.0) -> bool:
            for i in range(first, first + n):  # versions grow per message: the last one is unique
                pub.send(
                    WeightsApplied(
                        id=f"a-{version}-{i}", producer=f"p-{i % num_producers}", version=version + i, apply_time_s=0.1
                    )
                )
            last = f"weights.applied/p-{(first + n - 1) % num_producers}"
            deadline = time.monotonic() + timeout_s
            while getattr(hub.last.get(last), "version", None) != version + first + n - 1:  # the hub took them all
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.01)
            return True

        while not announce(0, 1, 0, timeout_s=0.1):  # slow joiner: publish until the hub hears
            pass
        if not announce(0, num_producers, 10):  # fill the cache
            raise RuntimeError(f"the hub did not take {num_producers} messages within 60 s")
        time.sleep(0.5)
        before = thread_cpu_s(thread.native_id)
        if not announce(0, count, 10 + num_producers):
            raise RuntimeError(f"the hub did not take {count} messages within 60 s")
        used = thread_cpu_s(thread.native_id) - before
        stop.set()
        thread.join()
        pub.close()
        hub.close()
    ctx.term()
    return used / count * 1e6


def main(argv: list[str] | None = None) -> int:
    """Print the per-message cost for each ``--peers`` value."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="1,16,64,256")
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument(
        "--only",
        choices=["all", "boxes", "hub"],
        default="all",
        help="boxes: the inbox and outbox state machines only; hub: the hub only",
    )
    args = parser.parse_args(argv)
    for n in (int(x) for x in args.peers.split(",")):
        if args.only in ("all", "hub"):
            print(f"{n:>4} producers: {hub_us(n):7.1f} us of hub CPU per weights.applied", flush=True)
        if args.only == "hub":
            continue
        print(f"{n:>4} peers: {inbox_us(n):7.1f} us per message in the inbox state machine alone", flush=True)
        print(f"{n:>4} peers: {outbox_us(n):7.1f} us per message in the outbox state machine alone", flush=True)
        if args.only == "boxes":
            continue
        per_msg, idle = measure(n, args.count)
        print(
            f"{n:>4} peers: {per_msg:7.1f} us of receiver I/O-thread CPU per message; idle (heartbeats): {idle:5.1f}% "
            f"of a core",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
