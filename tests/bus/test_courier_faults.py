"""The courier's error paths (:mod:`bus.courier`), each with a real fault over real ZeroMQ sockets.

- a bind that fails (an address already bound by another socket): the sockets made for the box
  are closed, so the endpoints it did bind are free again and ``ctx.term()`` does not hang;
- a call that times out (the I/O thread busy with a real slow command): it is withdrawn and never
  opens its socket later; one abandoned while running has what it opened closed when it returns;
- a close while the I/O thread is busy: the wake-up pipe stays open until the thread ends, then
  the thread closes it (and still says goodbye);
- exceptions inside the I/O loop: counted in ``rlbus_bus_courier_errors_total``; fewer than
  ``max_loop_errors`` in a row and delivery goes on, that many and the courier fails: every
  blocking box call raises :class:`bus.peers.CourierFailed` and the senders re-send what it held;
  a real component process whose courier fails exits 1 (``faulty_component.py``), which is what
  makes its supervisor restart it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from bus.courier import Courier
from bus.inbox import Inbox
from bus.messages import Prompt, ScoredGroup
from bus.peers import CourierFailed
from bus.topics import Endpoints
from configs.schema import dump_config, load_config
from reliable_peer import FAST, data_message
from test_reliable import PEER_DEATHS, WAIT_S, free_tcp_endpoint, open_hop, receive

ERRORS = "rlbus_bus_courier_errors_total"


def bind_succeeds(sockets, ep: str, timeout_s: float = WAIT_S) -> bool:
    """Whether a fresh socket can bind ``ep`` within ``timeout_s`` (then it is closed again):
    libzmq releases the address of a closed socket on its I/O thread, shortly after ``close``."""
    probe = sockets.socket(zmq.ROUTER)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            probe.bind(ep)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
            continue
        probe.close(linger=0)
        return True


def block_io_thread(courier: Courier, release: threading.Event, most_s: float) -> None:
    """Make ``courier``'s I/O thread run a real slow command (waiting for ``release``, at most
    ``most_s`` seconds) and return once it is inside it."""
    inside = threading.Event()

    def slow() -> None:
        inside.set()
        release.wait(most_s)

    courier.command(slow)
    assert inside.wait(WAIT_S), "the I/O thread never ran the slow command"


def test_a_bind_that_fails_leaves_no_socket_open(sockets, couriers, endpoint):
    holder = sockets.socket(zmq.ROUTER)
    taken = f"tcp://127.0.0.1:{holder.bind_to_random_port('tcp://127.0.0.1')}"
    free = free_tcp_endpoint()
    ctx = zmq.Context()  # its own context: a leaked socket would keep term() waiting
    courier = Courier(ctx, **FAST)
    with pytest.raises(zmq.ZMQError):  # binds `free`, then fails on `taken`
        courier.receiver("scored", [free, taken], bind=True, accept=(ScoredGroup,))
    assert bind_succeeds(sockets, free), "the failed open still holds the endpoint it bound first"
    outbox, inbox = open_hop(couriers(), courier, "scored", endpoint("scored"))  # the courier still works
    assert outbox.send(data_message("scored", "ok"), timeout_s=WAIT_S)
    assert receive(inbox, 1) == ["ok"]
    assert courier.close()
    term = threading.Thread(target=ctx.term, daemon=True)
    term.start()
    term.join(WAIT_S)
    assert not term.is_alive(), "ctx.term() hangs: a socket of the failed open was never closed"


def test_a_call_that_times_out_is_withdrawn_and_never_runs(sockets, couriers, endpoint):
    courier = couriers(call_timeout_s=0.2)
    ep = free_tcp_endpoint()
    busy = threading.Event()
    block_io_thread(courier, busy, 5.0)
    with pytest.raises(TimeoutError, match="withdrawn"):
        courier.receiver("scored", ep, bind=True, accept=(ScoredGroup,))
    busy.set()
    served = threading.Event()
    courier.command(served.set)  # queued after the withdrawn open: once it ran, the open had its turn
    assert served.wait(WAIT_S)
    assert bind_succeeds(sockets, ep), "the withdrawn open ran after the caller got its error"
    outbox, inbox = open_hop(couriers(), courier, "scored", endpoint("scored"))
    assert outbox.send(data_message("scored", "ok"), timeout_s=WAIT_S)
    assert receive(inbox, 1) == ["ok"]


def test_a_call_abandoned_while_running_closes_what_it_opened(sockets, couriers):
    courier = couriers(call_timeout_s=0.2)
    ep = free_tcp_endpoint()
    box = Inbox("scored", (ScoredGroup,), 8, session=courier.session, post=courier.command, stop=courier.stop)
    opened = threading.Event()

    def slow_open() -> list:
        time.sleep(0.6)  # still running when the caller gives up at 0.2 s
        links = courier._open(box, ep, True)
        opened.set()
        return links

    with pytest.raises(TimeoutError):
        courier._call(slow_open, undo=courier._discard)
    assert opened.wait(WAIT_S)
    served = threading.Event()
    courier.command(served.set)
    assert served.wait(WAIT_S)
    assert bind_succeeds(sockets, ep), "the abandoned open's socket is still bound"
    assert box not in courier.boxes


def test_close_while_the_thread_is_busy_leaves_its_pipe_to_the_thread(couriers, endpoint, metric, wait_until):
    ep = endpoint("prompts")
    busy_courier = couriers(close_timeout_s=0.2)
    outbox = couriers().sender("prompts", ep, bind=True)
    inbox = busy_courier.receiver("prompts", ep, bind=False, accept=(Prompt,))
    assert outbox.send(data_message("prompts", "held"), timeout_s=WAIT_S)
    assert receive(inbox, 1, done=False) == ["held"]  # custody stays with the busy process
    goodbyes = metric(PEER_DEATHS, topic="prompts", reason="goodbye")
    pipe = (busy_courier._wake_r, busy_courier._wake_w)
    release = threading.Event()
    block_io_thread(busy_courier, release, 10.0)
    assert busy_courier.close() is False  # gave up waiting after 0.2 s
    for fd in pipe:
        os.fstat(fd)  # still open: the thread may still poll it (raises OSError if closed)
    r, w = os.pipe()  # so a descriptor opened now cannot take the courier's numbers
    try:
        assert not {r, w} & set(pipe)
    finally:
        os.close(r)
        os.close(w)
    release.set()
    wait_until(lambda: not busy_courier._thread.is_alive(), WAIT_S, "the I/O thread ends after its command")
    assert busy_courier._wake_r == busy_courier._wake_w == -1  # and it closed the pipe itself
    wait_until(
        lambda: metric(PEER_DEATHS, topic="prompts", reason="goodbye") > goodbyes,
        WAIT_S,
        "its goodbye reaches the sender",
    )
    assert busy_courier.close() is True  # a second close: nothing left to do


def test_loop_errors_are_counted_and_too_many_in_a_row_fail_the_courier(couriers, endpoint, metric, wait_until):
    ep = endpoint("prompts")
    outbox = couriers().sender("prompts", ep, bind=True)
    faulty = couriers(max_loop_errors=3)
    inbox = faulty.receiver("prompts", ep, bind=False, accept=(Prompt,))
    errors = metric(ERRORS)

    def fault() -> None:
        raise RuntimeError("injected fault in the I/O loop")

    faulty.command(fault)
    faulty.command(fault)  # two in a row, under the limit of three
    wait_until(lambda: metric(ERRORS) == errors + 2, WAIT_S, "both errors counted")
    assert outbox.send(data_message("prompts", "p-0"), timeout_s=WAIT_S)
    assert receive(inbox, 1) == ["p-0"]  # a good wake in between: the count starts again
    assert outbox.send(data_message("prompts", "p-1"), timeout_s=WAIT_S)
    goodbyes = metric(PEER_DEATHS, topic="prompts", reason="goodbye")
    for _ in range(3):
        faulty.command(fault)
    with pytest.raises(CourierFailed, match="injected fault"):
        while True:  # p-1 may come out before the failure; then the next recv raises
            inbox.recv(timeout_s=WAIT_S)
    assert metric(ERRORS) == errors + 5
    with pytest.raises(CourierFailed):
        faulty.sender("outcomes", endpoint("outcomes"), bind=False)
    with pytest.raises(CourierFailed):
        inbox.done("p-1")
    wait_until(
        lambda: metric(PEER_DEATHS, topic="prompts", reason="goodbye") > goodbyes,
        WAIT_S,
        "the failed courier said goodbye",
    )
    spare = couriers().receiver("prompts", ep, bind=False, accept=(Prompt,))
    assert receive(spare, 1) == ["p-1"]  # what the failed process held is re-sent
    wait_until(lambda outbox=outbox: outbox.unfinished() == 0, WAIT_S, "all done")
    assert faulty.close() is True


def test_a_component_whose_courier_fails_exits_1(tmp_path: Path, sockets):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = load_config(None, [f"run_dir={run_dir}", "model.path=unused", "bus.heartbeat_s=0.1", "bus.dead_after_s=2"])
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    endpoints = Endpoints(cfg.bus.transport, run_dir)
    endpoints.ensure_dirs()
    supervisor = sockets.socket(zmq.PULL)  # takes the ready handshake and heartbeats, as busctl would
    supervisor.bind(endpoints.address("supervisor"))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bus.faulty_component", "--run-dir", str(run_dir), "--name", "faulty"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "CourierFailed" in proc.stderr and "injected fault" in proc.stderr, proc.stderr[-3000:]
