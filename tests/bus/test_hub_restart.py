"""The control hub survives a SIGKILL: a real hub process is killed and started again on the same
endpoints under live subscribers and publishers.

- a restarted hub loads its persisted last-value cache, so a subscriber that joins after the
  restart is caught up with what was announced before the kill (the hub writes its cache within
  ``PERSIST_INTERVAL_S`` of a change, not before forwarding it: the test kills it once the file
  holds the values, and a change younger than that is covered by the re-announcements below);
- what a :class:`bus.control.ControlPublisher` sent while the hub was down (dropped by ZeroMQ) is
  re-announced once it reconnects, so a live subscriber still gets the newest weights and
  ``run.done``;
- whether ZeroMQ drops or queues a message sent while the hub is down depends on whether the PUB
  side had noticed the disconnection yet, so the test asserts the re-announcements themselves.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from bus.control import ControlPublisher
from bus.codec import decode
from bus.hub import CACHE_NAME, PERSIST_INTERVAL_S
from bus.messages import RunDone, TrainerStep, WeightsReady

HUB_CODE = """
import sys, threading, zmq
from pathlib import Path
from bus.hub import ControlHub
hub = ControlHub(zmq.Context(), sys.argv[1], sys.argv[2], threading.Event(), cache_path=Path(sys.argv[3]))
if sys.argv[4] == "restart":
    hub.load_cache()
print("up", flush=True)
hub.run()
"""


class HubProcess:
    """A :class:`bus.hub.ControlHub` in its own process on fixed ipc endpoints under ``tmp``."""

    def __init__(self, tmp: Path) -> None:
        self.pub = f"ipc://{tmp}/control_pub"
        self.sub = f"ipc://{tmp}/control_sub"
        self.cache = tmp / CACHE_NAME
        self.proc: subprocess.Popen | None = None

    def start(self, mode: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HUB_CODE, self.pub, self.sub, str(self.cache), mode],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "up"

    def sigkill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def hub_process(tmp_path):
    hub = HubProcess(tmp_path)
    yield hub
    hub.close()


def weights(version: int) -> WeightsReady:
    return WeightsReady(
        id=f"w-{version}", version=version, method="filesystem", manifest=[], path=f"/w/v{version}", num_bytes=10
    )


def wait_persisted(cache: Path, ids: set[str], timeout_s: float = 5.0) -> None:
    """Wait until the hub's cache file holds messages with every id of ``ids``."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = {decode(f).id for f in msgpack.unpackb(cache.read_bytes())} if cache.is_file() else set()
        if ids <= held:
            return
        assert time.monotonic() < deadline, (
            f"{sorted(ids - held)} not persisted within {timeout_s} s (file: {sorted(held)})"
        )
        time.sleep(PERSIST_INTERVAL_S / 4)


def receive_until(sub, wanted, timeout_s: float = 15.0) -> list:
    """Messages received until ``wanted(received)`` holds; fails after ``timeout_s``."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    while not wanted(got):
        assert time.monotonic() < deadline, f"not received within {timeout_s} s; got {[m.id for m in got]}"
        msg = sub.recv(timeout_s=0.2)
        if msg is not None:
            got.append(msg)
    return got


def test_restarted_hub_catches_late_joiners_up_from_its_persisted_cache(hub_process, ctx, sockets, sync_control):
    hub_process.start("fresh")
    pub = sockets.bus("control_pub", "send", hub_process.pub, bind=False)
    live = sockets.bus("control_sub", "recv", hub_process.sub, bind=False)
    sync_control(
        lambda n: pub.send(TrainerStep(id=f"sync-{n}", step=0, version=0, metrics={})),
        lambda: live.recv(timeout_s=0.05),
    )
    for msg in (weights(3), TrainerStep(id="s-3", step=3, version=3, metrics={})):
        assert pub.send(msg)
    receive_until(live, lambda got: [m.id for m in got][-2:] == ["w-3", "s-3"])
    wait_persisted(hub_process.cache, {"w-3", "s-3"})

    hub_process.sigkill()
    hub_process.start("restart")
    late = sockets.bus("control_sub", "recv", hub_process.sub, bind=False)
    got = receive_until(late, lambda got: {"w-3", "s-3"} <= {m.id for m in got})
    assert next(m for m in got if m.id == "w-3").path == "/w/v3"


def test_publisher_reannounces_what_the_dead_hub_missed(hub_process, ctx, sockets, sync_control):
    hub_process.start("fresh")
    publisher = ControlPublisher(ctx, hub_process.pub)
    try:
        live = sockets.bus("control_sub", "recv", hub_process.sub, bind=False)
        sync_control(
            lambda n: publisher.send(TrainerStep(id=f"sync-{n}", step=0, version=0, metrics={})),
            lambda: live.recv(timeout_s=0.05),
        )
        assert publisher.send(weights(1))
        receive_until(live, lambda got: any(m.id == "w-1" for m in got))

        hub_process.sigkill()
        assert publisher.send(weights(2))  # queued nowhere: the hub is gone
        assert publisher.send(RunDone(id="done", step=2, reason="max_steps"))
        time.sleep(0.3)
        hub_process.start("restart")

        # sent once while the hub was down (lost or not), then re-announced after the reconnection
        def twice(got):
            ids = [m.id for m in got]
            return ids.count("w-2") >= 2 and ids.count("done") >= 2

        got = receive_until(live, twice)
        assert publisher.reconnects == 1
        # (the restarted hub's cache catches ``live`` up with w-1 first; the newest comes last)
        assert [m.id for m in got if isinstance(m, WeightsReady)][-1] == "w-2"
        # the restarted hub cached the re-announced values: a joiner after the restart gets them too
        late = sockets.bus("control_sub", "recv", hub_process.sub, bind=False)
        got = receive_until(late, lambda got: {"w-2", "done"} <= {m.id for m in got})
    finally:
        publisher.close()


def test_an_unreadable_cache_starts_the_hub_empty(hub_process, ctx, sockets):
    hub_process.cache.write_bytes(b"\x93garbage")
    hub_process.start("restart")  # unreadable: starts empty, with a warning, and keeps running
    late = sockets.bus("control_sub", "recv", hub_process.sub, bind=False)
    assert late.recv(timeout_s=1.0) is None
    assert hub_process.proc.poll() is None
