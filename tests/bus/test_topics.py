"""The topic table and endpoint resolution: socket types per topic, ipc paths in a short socket
dir, tcp ports at fixed offsets; bad input raises; BusSocket refuses the data topics."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import zmq

from bus.sockets import BusSocket
from bus.topics import IPC_PATH_MAX, TOPICS, Endpoints, socket_dir

ALL_ADDRESSES = [(t, 0) for t in TOPICS] + [("rollouts", 3), ("rollouts", 15)]
DATA_TOPICS = sorted(t for t, spec in TOPICS.items() if spec.reliable)


def test_ipc_addresses_in_run_socket_dir():
    run_dir = Path("/tmp/rlbus-t/run")
    eps = Endpoints("ipc", run_dir)
    assert socket_dir(run_dir) == run_dir / "sock"
    assert eps.address("batches") == "ipc:///tmp/rlbus-t/run/sock/batches"
    assert eps.address("control_pub") == "ipc:///tmp/rlbus-t/run/sock/control_pub"
    assert eps.address("rollouts") == "ipc:///tmp/rlbus-t/run/sock/rollouts-0"
    assert eps.address("rollouts", 2) == "ipc:///tmp/rlbus-t/run/sock/rollouts-2"
    addresses = [eps.address(t, i) for t, i in ALL_ADDRESSES]
    assert len(set(addresses)) == len(addresses)


def test_tcp_addresses_at_port_offsets():
    eps = Endpoints("tcp", Path("/unused"), host="127.0.0.1", base_port=6000)
    assert eps.address("prompts") == "tcp://127.0.0.1:6000"
    assert eps.address("batches") == f"tcp://127.0.0.1:{6000 + TOPICS['batches'].port_offset}"
    assert eps.address("rollouts", 3) == f"tcp://127.0.0.1:{6000 + TOPICS['rollouts'].port_offset + 3}"
    ports = [int(eps.address(t, i).rsplit(":", 1)[1]) for t, i in ALL_ADDRESSES]
    assert len(set(ports)) == len(ports)


def test_long_run_dir_falls_back_to_short_socket_dir(tmp_path, ctx):
    long_dir = tmp_path / ("r" * 60) / ("u" * 60)
    other = tmp_path / ("r" * 60) / ("v" * 60)
    sock_dir = socket_dir(long_dir)
    try:
        assert not sock_dir.is_relative_to(tmp_path)
        assert sock_dir == socket_dir(long_dir) != socket_dir(other)  # stable, per run
        eps = Endpoints("ipc", long_dir)
        for topic, index in ALL_ADDRESSES:
            addr = eps.address(topic, index)
            assert addr.startswith(f"ipc://{sock_dir}/")
            assert len(addr.removeprefix("ipc://")) <= IPC_PATH_MAX
        eps.ensure_dirs()
        # The address is usable: bind and connect a real pair through it.
        recv = BusSocket(ctx, "supervisor", "recv", eps.address("supervisor"), bind=True)
        send = BusSocket(ctx, "supervisor", "send", eps.address("supervisor"), bind=False)
        try:
            send.sock.send(b"ping")
            assert recv.sock.poll(2000, zmq.POLLIN)
            assert recv.sock.recv() == b"ping"
        finally:
            send.sock.close(linger=0)
            recv.sock.close(linger=0)
    finally:
        for p in sorted(sock_dir.glob("*"), reverse=True):
            p.unlink()
        if sock_dir.exists():
            sock_dir.rmdir()


def test_tcp_ensure_dirs_is_a_no_op(tmp_path):
    Endpoints("tcp", tmp_path / "run").ensure_dirs()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("transport", ["inproc", "IPC", "", "udp"])
def test_bad_transport_raises(transport):
    with pytest.raises(ValueError, match="transport"):
        Endpoints(transport, Path("/tmp/x"))


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_bad_topic_or_index_raises(transport):
    eps = Endpoints(transport, Path("/tmp/x"))
    with pytest.raises(ValueError, match="unknown topic"):
        eps.address("control")
    with pytest.raises(ValueError, match="single endpoint"):
        eps.address("batches", 1)


def test_bus_socket_rejects_bad_topic_or_direction(ctx):
    with pytest.raises(ValueError, match="unknown topic"):
        BusSocket(ctx, "nope", "send", "tcp://127.0.0.1:1", bind=False)
    with pytest.raises(ValueError, match="direction"):
        BusSocket(ctx, "supervisor", "both", "tcp://127.0.0.1:1", bind=False)


@pytest.mark.parametrize("topic", DATA_TOPICS)
@pytest.mark.parametrize("direction", ["send", "recv"])
def test_bus_socket_refuses_data_topics(topic, direction, ctx):
    with pytest.raises(ValueError, match="bus.courier.Courier"):
        BusSocket(ctx, topic, direction, "tcp://127.0.0.1:1", bind=False)


def test_topic_table_socket_types():
    # data topics: the binder is a ROUTER, connectors one DEALER per endpoint (bus.courier)
    binder_sends = {"prompts": True, "rollouts": True, "batches": True, "scored": False, "outcomes": False}
    assert set(DATA_TOPICS) == set(binder_sends)
    for topic, sends in binder_sends.items():
        spec = TOPICS[topic]
        assert spec.reliable and spec.blocks, topic
        assert (spec.send_type, spec.recv_type) == ((zmq.ROUTER, zmq.DEALER) if sends else (zmq.DEALER, zmq.ROUTER)), (
            topic
        )
    assert (TOPICS["supervisor"].send_type, TOPICS["supervisor"].recv_type) == (zmq.PUSH, zmq.PULL)
    assert TOPICS["supervisor"].blocks and not TOPICS["control_pub"].blocks
    assert (TOPICS["control_pub"].send_type, TOPICS["control_sub"].recv_type) == (zmq.PUB, zmq.SUB)


def test_bus_socket_over_tcp_random_port(sockets, example):
    recv = sockets.bus("supervisor", "recv", "tcp://127.0.0.1:*", bind=True)
    addr = recv.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    send = sockets.bus("supervisor", "send", addr, bind=False)
    assert send.send(example("component.ready"), timeout_s=2.0)
    got = recv.recv(timeout_s=2.0)
    assert got is not None and got.id == example("component.ready").id


def test_data_topics_over_tcp_at_their_addresses(couriers, example):
    # a free base port: the addresses of every data topic are bindable and carry traffic
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        base = probe.getsockname()[1]
    eps = Endpoints("tcp", Path("/unused"), base_port=base - TOPICS["scored"].port_offset)
    inbox = couriers().receiver("scored", eps.address("scored"), bind=True, accept=(type(example("scored")),))
    outbox = couriers().sender("scored", eps.address("scored"), bind=False)
    assert outbox.send(example("scored"), timeout_s=2.0)
    got = inbox.recv(timeout_s=2.0)
    assert got is not None and got.id == example("scored").id


def test_the_table_names_the_config_topic_names():
    """``configs.topic_names`` (zmq-free, for checking ``bus.hosts``) and :data:`TOPICS` name the same topics."""
    from configs.topic_names import TOPIC_NAMES, endpoint_key_ok

    assert tuple(TOPICS) == TOPIC_NAMES
    assert all(endpoint_key_ok(t) for t in TOPICS if t != "rollouts")
    assert endpoint_key_ok("rollouts-0") and endpoint_key_ok("rollouts-12")
    assert not any(endpoint_key_ok(k) for k in ("rollouts", "rollouts-", "rollouts-x", "rollout-0", "nope"))
