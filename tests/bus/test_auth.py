"""CurveZMQ on tcp://: allowed clients talk, unknown keys and plaintext peers get nothing through.

Every peer has its own ``zmq.Context`` (as a separate process would), CURVE-enabled or not;
endpoints are ``tcp://127.0.0.1:*`` random ports; every socket is closed with ``linger=0`` and
every authenticator stopped at teardown; "nothing arrives" is checked with a bounded wait after
a positive control shows the same receiver working.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import socket
from pathlib import Path
from typing import Any

import pytest
import zmq

from bus import auth, busctl
from bus.component import Component
from bus.messages import ComponentReady, GroupsDropped, Prompt, TrainerStep, new_id
from bus.sockets import BusSocket
from bus.supervisor import Supervisor
from configs.schema import ConfigError, load_config

ANY_PORT = "tcp://127.0.0.1:*"
SILENCE_S = 1.0
"""How long a receiver must stay empty for "nothing got through", seconds."""


@pytest.fixture(scope="module")
def keys_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("curve") / "keys"
    auth.create_keys(path)
    return path


@pytest.fixture(scope="module")
def keys(keys_dir) -> auth.CurveKeys:
    return auth.CurveKeys.load(keys_dir)


@pytest.fixture
def intruder_keys(keys) -> auth.CurveKeys:
    """Knows the server's public key (it is no secret) but has a fresh, unlisted client keypair."""
    public, secret = zmq.curve_keypair()
    return dataclasses.replace(keys, client_public=public, client_secret=secret)


class Peers:
    """Contexts (one per simulated process) and their sockets; closes all of it at teardown."""

    def __init__(self) -> None:
        self.contexts: list[zmq.Context] = []
        self.sockets: list[zmq.Socket] = []

    def context(self, keys: auth.CurveKeys | None) -> zmq.Context:
        ctx = zmq.Context()
        auth.enable(ctx, keys)
        self.contexts.append(ctx)
        return ctx

    def bus(self, ctx: zmq.Context, topic: str, direction: str, endpoint: str, *, bind: bool) -> BusSocket:
        bs = BusSocket(ctx, topic, direction, endpoint, bind=bind)
        self.sockets.append(bs.sock)
        return bs

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        for ctx in self.contexts:
            auth.disable(ctx)  # stop the authenticator thread before its context goes
            ctx.destroy(linger=0)


@pytest.fixture
def peers():
    tracker = Peers()
    yield tracker
    tracker.close()


@pytest.fixture
def curve_hub(peers, keys, make_hub):
    return make_hub(peers.context(keys), ANY_PORT, ANY_PORT)


def bound(bs: BusSocket) -> str:
    """The real endpoint of a socket bound to a ``:*`` port."""
    return bs.sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def prompt(tag: str) -> Prompt:
    return Prompt(id=f"{tag}-{new_id()}", index=0, step=0, task="reverse_text", messages=[], info={})


def drain(sub: BusSocket, timeout_s: float = SILENCE_S) -> list[Any]:
    out = []
    while (msg := sub.recv(timeout_s=timeout_s)) is not None:
        out.append(msg)
    return out


@pytest.fixture(params=["unknown_key", "plaintext"])
def intruder_ctx(request, peers, intruder_keys) -> zmq.Context:
    """A peer with an unlisted CURVE keypair, or one without CURVE at all."""
    return peers.context(intruder_keys if request.param == "unknown_key" else None)


# -- (1) allowed clients -------------------------------------------------------------------------


def test_allowed_client_push_pull_both_ways(peers, keys):
    server, client = peers.context(keys), peers.context(keys)
    pull = peers.bus(server, "prompts", "recv", ANY_PORT, bind=True)
    push = peers.bus(client, "prompts", "send", bound(pull), bind=False)
    sent = prompt("up")
    assert push.send(sent, timeout_s=5)
    got = pull.recv(timeout_s=5)
    assert got is not None and got.id == sent.id
    assert auth.for_context(server).authenticator is not None  # the binder authenticates
    assert auth.for_context(client).authenticator is None  # a pure connector needs no ZAP handler

    push_b = peers.bus(server, "batches", "send", ANY_PORT, bind=True)
    pull_b = peers.bus(client, "batches", "recv", bound(push_b), bind=False)
    down = prompt("down")
    assert push_b.send(down, timeout_s=5)
    got = pull_b.recv(timeout_s=5)
    assert got is not None and got.id == down.id


def test_allowed_client_through_control_hub(peers, keys, curve_hub, sync_control):
    client = peers.context(keys)
    pub = peers.bus(client, "control_pub", "send", curve_hub.pub_endpoint, bind=False)
    sub = peers.bus(client, "control_sub", "recv", curve_hub.sub_endpoint, bind=False)
    sync_control(lambda n: pub.send(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="sync")),
                 lambda: sub.recv(timeout_s=0.05))
    sent = [TrainerStep(id=new_id(), step=i, version=i, metrics={}) for i in range(5)]
    for msg in sent:
        assert pub.send(msg)
    assert [m.id for m in drain(sub, timeout_s=0.5)] == [m.id for m in sent]


# -- (2) unknown keys and (3) plaintext peers ----------------------------------------------------


def test_intruder_push_never_arrives(peers, keys, intruder_ctx):
    pull = peers.bus(peers.context(keys), "prompts", "recv", ANY_PORT, bind=True)
    intruder = peers.bus(intruder_ctx, "prompts", "send", bound(pull), bind=False)
    for _ in range(3):
        intruder.send(prompt("intruder"), timeout_s=0.2)  # IMMEDIATE: usually refused outright
    assert pull.recv(timeout_s=SILENCE_S) is None
    # Positive control: the same receiver takes an allowed peer's message, and only that one.
    friend = peers.bus(peers.context(keys), "prompts", "send", bound(pull), bind=False)
    ok = prompt("friend")
    assert friend.send(ok, timeout_s=5)
    assert [m.id for m in drain(pull, timeout_s=0.5)] == [ok.id]


def test_intruder_pull_receives_nothing(peers, keys, intruder_ctx):
    push = peers.bus(peers.context(keys), "prompts", "send", ANY_PORT, bind=True)
    intruder = peers.bus(intruder_ctx, "prompts", "recv", bound(push), bind=False)
    # With only the intruder connected the PUSH has no peer at all: nothing leaves.
    assert not push.send(prompt("lost"), timeout_s=SILENCE_S)
    friend = peers.bus(peers.context(keys), "prompts", "recv", bound(push), bind=False)
    sent = [prompt("friend") for _ in range(10)]
    for msg in sent:
        assert push.send(msg, timeout_s=5)
    got = [friend.recv(timeout_s=5) for _ in sent]
    assert [m.id if m else None for m in got] == [m.id for m in sent]  # none load-balanced away
    assert intruder.recv(timeout_s=0.5) is None


def test_intruder_gets_nothing_through_control_hub(peers, keys, curve_hub, intruder_ctx, sync_control):
    client = peers.context(keys)
    pub = peers.bus(client, "control_pub", "send", curve_hub.pub_endpoint, bind=False)
    sub = peers.bus(client, "control_sub", "recv", curve_hub.sub_endpoint, bind=False)
    sync_control(lambda n: pub.send(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="sync")),
                 lambda: sub.recv(timeout_s=0.05))
    bad_pub = peers.bus(intruder_ctx, "control_pub", "send", curve_hub.pub_endpoint, bind=False)
    bad_sub = peers.bus(intruder_ctx, "control_sub", "recv", curve_hub.sub_endpoint, bind=False)
    # The intruder publishes for a while: nothing of it is forwarded.
    for i in range(10):
        bad_pub.send(TrainerStep(id=f"intruder-{i}", step=99, version=99, metrics={}))
        assert sub.recv(timeout_s=0.1) is None
    # Allowed traffic (incl. a last-value type the hub would re-announce) flows, but not to the intruder.
    sent = [TrainerStep(id=new_id(), step=i, version=i, metrics={}) for i in range(5)]
    for msg in sent:
        assert pub.send(msg)
    assert [m.id for m in drain(sub, timeout_s=0.5)] == [m.id for m in sent]
    assert bad_sub.recv(timeout_s=SILENCE_S) is None


# -- (4) busctl keys -> config -> components and supervisor --------------------------------------


def free_base_port() -> int:
    """A ``bus.base_port`` whose first topic ports (offsets 0-5) were free a moment ago."""
    for _ in range(100):
        base = random.randrange(20_000, 60_000)
        probes: list[socket.socket] = []
        try:
            for k in range(6):
                probes.append(socket.create_server(("127.0.0.1", base + k)))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    pytest.fail("no free tcp port range")


def test_busctl_keys_feed_the_config(tmp_path, capsys):
    assert busctl.main(["keys", str(tmp_path / "keys")]) == 0
    out = capsys.readouterr().out
    use = next(line for line in out.splitlines() if line.strip().startswith("use:"))
    overrides = use.split("busctl up CONFIG", 1)[1].split()  # printed as ready-made overrides
    cfg = load_config(None, [*overrides, f"run_dir={tmp_path / 'run'}", f"bus.base_port={free_base_port()}"])
    assert cfg.bus.transport == "tcp" and Path(cfg.bus.curve_keys_dir) == (tmp_path / "keys").resolve()
    (tmp_path / "run").mkdir()

    sup = Supervisor(cfg)
    packer, trainer = Component(cfg, "packer", 0), Component(cfg, "trainer", 0)
    inbox = None
    try:
        # Supervisor handshake: bound by the supervisor, sent by a component.
        inbox = BusSocket(sup.ctx, "supervisor", "recv", sup.endpoints.address("supervisor"), bind=True,
                          accept=(ComponentReady,))
        packer.report_ready(metrics_port=9100)
        ready = inbox.recv(timeout_s=5)
        assert isinstance(ready, ComponentReady) and ready.name == "packer"
        # A data topic between two components.
        batches = packer.endpoints.address("batches")
        push = packer.socket("batches", "send", batches, bind=True)
        pull = trainer.socket("batches", "recv", batches, bind=False)
        assert push.send(prompt("batch"), timeout_s=5)
        assert pull.recv(timeout_s=5) is not None
        assert auth.for_context(packer.ctx).authenticator is not None
    finally:
        for comp in (packer, trainer):
            for bs in comp._sockets:
                bs.sock.close(linger=0)
            comp.close()  # stops the authenticator, terms the context
        if inbox is not None:
            inbox.sock.close(linger=0)
        sup.shutdown()
    assert auth.for_context(packer.ctx) is None and auth.for_context(sup.ctx) is None


def test_busctl_keys_never_overwrites(tmp_path, capsys):
    assert busctl.main(["keys", str(tmp_path / "keys"), "--clients", "3"]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "keys").rglob("*") if p.is_file()}
    assert {"server.key", "server.key_secret", "components.key_secret", "client-1.key", "client-2.key_secret"} <= set(before)
    assert busctl.main(["keys", str(tmp_path / "keys")]) == 1
    assert "already holds" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in (tmp_path / "keys").rglob("*") if p.is_file()} == before
    assert (tmp_path / "keys" / "server.key_secret").stat().st_mode & 0o077 == 0


# -- config validation ----------------------------------------------------------------------------


def test_missing_key_dir_or_file_is_a_config_error(tmp_path, keys_dir):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=str(missing)):
        load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={missing}"])
    with pytest.raises(ConfigError, match=str(keys_dir / "clients" / "nobody.key_secret")):
        load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={keys_dir}", "bus.curve_client=nobody"])
    partial = tmp_path / "partial"
    auth.create_keys(partial)
    (partial / "server.key_secret").unlink()
    with pytest.raises(ConfigError, match=str(partial / "server.key_secret")):
        load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={partial}"])


def test_curve_is_off_without_keys_and_on_ipc(keys_dir, caplog):
    assert auth.keys_from_config(load_config(None, ["bus.transport=tcp"]).bus) is None
    ipc = load_config(None, ["bus.transport=ipc", f"bus.curve_keys_dir={keys_dir}"])  # checked, allowed
    with caplog.at_level(logging.WARNING, logger="bus.auth"):
        assert auth.keys_from_config(ipc.bus) is None
    assert "tcp:// only" in caplog.text
    tcp = load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={keys_dir}"])
    assert auth.keys_from_config(tcp.bus) == auth.CurveKeys.load(keys_dir)
