"""``busctl scale servers=N`` against a real supervisor and control hub (tests/busctl/test_supervisor.py's
harness): the request reaches the producers on the control channel (the hub keeps it for a producer that
subscribes later), the run's answer is what the producers answer, and what cannot be resized is refused.
The producer's side (``ServerEngine.resize`` on real vLLM servers) is tests/producers/test_server_engine.py's.
"""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from busctl import cli as busctl
from bus.messages import ServersScaled, ServersWanted, new_id
from bus.sockets import BusSocket
from tests.busctl.test_supervisor import WAIT_S, make_cfg, supervisors, table  # noqa: F401 (a fixture)


class FakeProducerAnswers:
    """Plays producer-0's control side in a thread: records every ``servers.wanted`` it hears and answers the
    ones it has not answered yet with ``servers.scaled`` (``error`` if given)."""

    def __init__(self, run, error: str = "") -> None:
        self.heard: list[ServersWanted] = []
        self.error = error
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        address = run.sup.endpoints.address
        self._sub = BusSocket(self._ctx, "control_sub", "recv", address("control_sub"), bind=False)
        self._pub = BusSocket(self._ctx, "control_pub", "send", address("control_pub"), bind=False)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        answered = set()
        while not self._stop.is_set():
            msg = self._sub.recv(timeout_s=0.1)
            if not isinstance(msg, ServersWanted):
                continue
            self.heard.append(msg)
            if msg.id not in answered:
                answered.add(msg.id)
                self._pub.send(
                    ServersScaled(
                        id=new_id(), producer="producer-0", request=msg.id, servers=msg.servers, error=self.error
                    )
                )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close()
        self._pub.close()
        self._ctx.term()


def test_busctl_scale_servers_reaches_the_producers_and_waits_for_their_answer(tmp_path, supervisors, capsys):
    cfg = make_cfg(tmp_path / "run", "producers.engine=server")
    run = supervisors(cfg, table("hub", "rewards-0", "producer-0"))
    run.all_running()
    run_dir = str(run.run_dir)

    fake = FakeProducerAnswers(run)
    try:
        assert busctl.main(["scale", run_dir, "servers=3"]) == 0, capsys.readouterr().err
        scale = run.status()["scale"]
        assert (scale["state"], scale["targets"], scale["servers_in_sync"]) == ("done", {"servers": 3}, ["producer-0"])
        assert scale["added"] == scale["removed"] == []  # no component started or stopped
        assert fake.heard and {m.servers for m in fake.heard} == {3}
        rid = fake.heard[0].id
    finally:
        fake.close()

    # a producer that subscribes later (restarted, or added by producers=N) hears the last request from the hub
    late = FakeProducerAnswers(run)
    try:
        deadline = time.monotonic() + WAIT_S
        while not late.heard and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [(m.id, m.servers) for m in late.heard[:1]] == [(rid, 3)]
    finally:
        late.close()

    # a producer that cannot resize: the request fails with its reason, the run goes on
    failing = FakeProducerAnswers(run, error="RuntimeError('no room')")
    try:
        assert busctl.main(["scale", run_dir, "servers=1"]) == 1
        assert "producer-0: RuntimeError('no room')" in capsys.readouterr().err
        assert run.status()["scale"]["state"] == "failed"
    finally:
        failing.close()
    assert all(c["state"] == "running" for c in run.components().values())

    for bad, match in [("servers=0", "from 1 to 64"), ("servers=65", "from 1 to 64"), ("servers=x", "whole number")]:
        assert busctl.main(["scale", run_dir, bad]) == 2
        assert match in capsys.readouterr().err


def test_scale_servers_is_refused_where_producers_do_not_start_servers(tmp_path):
    from busctl.scaling import scale_targets

    assert scale_targets(make_cfg(tmp_path, "producers.engine=server"), {"servers": 2, "rewards": 3}) == {
        "rewards": 3,
        "servers": 2,
    }
    for overrides, match in [
        ([], "producers.engine: server"),
        (["producers.engine=server", "producers.servers=[http://127.0.0.1:8000]"], "attached by producers.servers"),
    ]:
        with pytest.raises(ValueError, match=match):
            scale_targets(make_cfg(tmp_path, *overrides), {"servers": 2})
