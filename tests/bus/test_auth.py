"""CurveZMQ on tcp://: allowed clients talk, unknown keys and plaintext peers get nothing through.

Every peer has its own ``zmq.Context`` (as a separate process would), CURVE-enabled or not, and
its own :class:`bus.courier.Courier` for the data topics (ROUTER/DEALER); endpoints are random
tcp ports on 127.0.0.1; every courier and socket is closed and every authenticator stopped at
teardown; "nothing arrives" is checked with a bounded wait after a positive control shows the
same receiver working.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import zmq

from bus import auth
from bus.component import Component
from bus.messages import ComponentReady, GroupsDropped, Prompt, ScoredGroup, TrainerStep, new_id
from bus.courier import Courier
from bus.sockets import BusSocket
from busctl import cli
from busctl.supervisor import Supervisor
from configs.schema import load_config
from reliable_peer import FAST, RawPeer, data_message, envelope

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
    """Contexts (one per simulated process), their couriers and sockets; closes all of it at teardown."""

    def __init__(self) -> None:
        self.contexts: list[zmq.Context] = []
        self.couriers: list[Courier] = []
        self.sockets: list[zmq.Socket] = []

    def context(self, keys: auth.CurveKeys | None) -> zmq.Context:
        ctx = zmq.Context()
        auth.enable(ctx, keys)
        self.contexts.append(ctx)
        return ctx

    def courier(self, ctx: zmq.Context) -> Courier:
        """The data-topic courier of the process that ``ctx`` stands for."""
        self.couriers.append(Courier(ctx, **FAST))
        return self.couriers[-1]

    def bus(self, ctx: zmq.Context, topic: str, direction: str, endpoint: str, *, bind: bool) -> BusSocket:
        bs = BusSocket(ctx, topic, direction, endpoint, bind=bind)
        self.sockets.append(bs.sock)
        return bs

    def raw(self, ctx: zmq.Context, sock_type: int, endpoint: str) -> RawPeer:
        """A raw DEALER/ROUTER speaking the delivery protocol by hand (CURVE as ``ctx`` has it)."""
        peer = RawPeer(ctx, sock_type, endpoint, session="intruder")
        self.sockets.append(peer.sock)
        return peer

    def close(self) -> None:
        for courier in self.couriers:
            courier.close()
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


def scored(tag: str) -> ScoredGroup:
    return data_message("scored", f"{tag}-{new_id()}")


def free_endpoint() -> str:
    """A tcp endpoint on a port that was free a moment ago (a courier binds it; no ``:*`` there)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


def received_ids(inbox, timeout_s: float = SILENCE_S) -> list[str]:
    out = []
    while (msg := inbox.recv(timeout_s=timeout_s)) is not None:
        out.append(msg.id)
        inbox.done(msg.id)
        timeout_s = 0.3
    return out


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


def test_allowed_client_data_topics_both_ways(peers, keys):
    server, client = peers.context(keys), peers.context(keys)
    # prompts: the binder sends (ROUTER), the connector receives (DEALER)
    ep = free_endpoint()
    outbox = peers.courier(server).sender("prompts", ep, bind=True)
    inbox = peers.courier(client).receiver("prompts", ep, bind=False, accept=(Prompt,))
    sent = prompt("down")
    assert outbox.send(sent, timeout_s=5)
    got = inbox.recv(timeout_s=5)
    assert got is not None and got.id == sent.id
    assert auth.for_context(server).authenticator is not None  # the binder authenticates
    assert auth.for_context(client).authenticator is None  # a pure connector needs no ZAP handler

    # scored: the binder receives (ROUTER), the connector sends (DEALER)
    ep = free_endpoint()
    inbox_s = peers.courier(server).receiver("scored", ep, bind=True, accept=(ScoredGroup,))
    outbox_s = peers.courier(client).sender("scored", ep, bind=False)
    up = scored("up")
    assert outbox_s.send(up, timeout_s=5)
    got = inbox_s.recv(timeout_s=5)
    assert got is not None and got.id == up.id


def test_allowed_client_supervisor_push_pull(peers, keys):
    pull = peers.bus(peers.context(keys), "supervisor", "recv", ANY_PORT, bind=True)
    push = peers.bus(peers.context(keys), "supervisor", "send", bound(pull), bind=False)
    sent = ComponentReady(id=new_id(), name="packer", pid=1, metrics_port=2)
    assert push.send(sent, timeout_s=5)
    got = pull.recv(timeout_s=5)
    assert got is not None and got.id == sent.id


def test_allowed_client_through_control_hub(peers, keys, curve_hub, sync_control):
    client = peers.context(keys)
    pub = peers.bus(client, "control_pub", "send", curve_hub.pub_endpoint, bind=False)
    sub = peers.bus(client, "control_sub", "recv", curve_hub.sub_endpoint, bind=False)
    sync_control(
        lambda n: pub.send(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="sync")), lambda: sub.recv(timeout_s=0.05)
    )
    sent = [TrainerStep(id=new_id(), step=i, version=i, metrics={}) for i in range(5)]
    for msg in sent:
        assert pub.send(msg)
    assert [m.id for m in drain(sub, timeout_s=0.5)] == [m.id for m in sent]


# -- (2) unknown keys and (3) plaintext peers ----------------------------------------------------


def test_intruder_push_never_arrives(peers, keys, intruder_ctx):
    pull = peers.bus(peers.context(keys), "supervisor", "recv", ANY_PORT, bind=True)
    intruder = peers.bus(intruder_ctx, "supervisor", "send", bound(pull), bind=False)
    for _ in range(3):
        intruder.send(ComponentReady(id=new_id(), name="x", pid=1, metrics_port=1), timeout_s=0.2)  # IMMEDIATE: refused
    assert pull.recv(timeout_s=SILENCE_S) is None
    # Positive control: the same receiver takes an allowed peer's message, and only that one.
    friend = peers.bus(peers.context(keys), "supervisor", "send", bound(pull), bind=False)
    ok = ComponentReady(id=new_id(), name="packer", pid=1, metrics_port=2)
    assert friend.send(ok, timeout_s=5)
    assert [m.id for m in drain(pull, timeout_s=0.5)] == [ok.id]


def test_intruder_sender_gets_nothing_into_a_reliable_receiver(peers, keys, intruder_ctx, metric):
    ep = free_endpoint()
    inbox = peers.courier(peers.context(keys)).receiver("scored", ep, bind=True, accept=(ScoredGroup,))
    rejected_before = sum(
        metric("rlbus_bus_rejected_total", topic="scored", reason=r) for r in ("envelope", "header", "wrong_direction")
    )
    # a real outbox with the intruder's credentials, and a raw DEALER speaking the protocol by hand
    outbox = peers.courier(intruder_ctx).sender("scored", ep, bind=False)
    assert outbox.send(scored("intruder"), timeout_s=1)  # taken into its own outbox, never delivered
    raw = peers.raw(intruder_ctx, zmq.DEALER, ep)
    raw.send([envelope("H", "intruder", None)])
    raw.send_data(scored("raw-intruder"))
    raw.send([b"\xc1garbage"])
    assert inbox.recv(timeout_s=SILENCE_S) is None
    assert raw.recv(timeout_s=0.2) is None  # no credit, no ack: the receiver never heard of it
    assert outbox.unfinished() == 1
    assert (
        sum(
            metric("rlbus_bus_rejected_total", topic="scored", reason=r)
            for r in ("envelope", "header", "wrong_direction")
        )
        == rejected_before
    )  # nothing even reached it
    # Positive control: an allowed sender gets through, and only its message arrives.
    friend = peers.courier(peers.context(keys)).sender("scored", ep, bind=False)
    ok = scored("friend")
    assert friend.send(ok, timeout_s=5)
    assert received_ids(inbox, timeout_s=5) == [ok.id]


def test_intruder_receiver_gets_nothing_from_a_reliable_sender(peers, keys, intruder_ctx):
    ep = free_endpoint()
    outbox = peers.courier(peers.context(keys)).sender("prompts", ep, bind=True)
    intruder = peers.courier(intruder_ctx).receiver("prompts", ep, bind=False, accept=(Prompt,))
    raw = peers.raw(intruder_ctx, zmq.DEALER, ep)
    raw.send_ack(100)  # a hello with plenty of credit: if it got through, messages would come to it
    sent = [prompt("for-friend") for _ in range(outbox.capacity)]
    for msg in sent:
        assert outbox.send(msg, timeout_s=5)
    assert intruder.recv(timeout_s=SILENCE_S) is None
    assert raw.recv(timeout_s=0.2) is None
    assert outbox.unfinished() == len(sent)  # nothing left the sender: no peer ever completed a handshake
    friend = peers.courier(peers.context(keys)).receiver("prompts", ep, bind=False, accept=(Prompt,))
    assert received_ids(friend, timeout_s=5) == [m.id for m in sent]  # every one, in order, none held elsewhere
    assert intruder.recv(timeout_s=0.3) is None


def test_intruder_gets_nothing_through_control_hub(peers, keys, curve_hub, intruder_ctx, sync_control):
    client = peers.context(keys)
    pub = peers.bus(client, "control_pub", "send", curve_hub.pub_endpoint, bind=False)
    sub = peers.bus(client, "control_sub", "recv", curve_hub.sub_endpoint, bind=False)
    sync_control(
        lambda n: pub.send(GroupsDropped(id=f"sync-{n}", group_ids=[], reason="sync")), lambda: sub.recv(timeout_s=0.05)
    )
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
    assert cli.main(["keys", str(tmp_path / "keys")]) == 0
    out = capsys.readouterr().out
    use = next(line for line in out.splitlines() if line.strip().startswith("use:"))
    overrides = use.split("busctl up CONFIG", 1)[1].split()  # printed as ready-made overrides
    cfg = load_config(None, [*overrides, f"run_dir={tmp_path / 'run'}", f"bus.base_port={free_base_port()}"])
    assert cfg.bus.transport == "tcp" and Path(cfg.bus.curve_keys_dir) == (tmp_path / "keys").resolve()
    (tmp_path / "run").mkdir()

    sup = Supervisor(cfg)
    packer, trainer = Component(cfg, "packer", 0), Component(cfg, "trainer", 0)
    handshake = None
    try:
        # Supervisor handshake: bound by the supervisor, sent by a component.
        handshake = BusSocket(
            sup.ctx, "supervisor", "recv", sup.endpoints.address("supervisor"), bind=True, accept=(ComponentReady,)
        )
        packer.report_ready(metrics_port=9100)
        ready = handshake.recv(timeout_s=5)
        assert isinstance(ready, ComponentReady) and ready.name == "packer"
        # A data topic between two components.
        batches = packer.endpoints.address("batches")
        outbox = packer.reliable_sender("batches", batches, bind=True)
        inbox = trainer.reliable_receiver("batches", batches, bind=False, accept=(Prompt,))
        assert outbox.send(prompt("batch"), timeout_s=5)
        assert inbox.recv(timeout_s=5) is not None
        assert auth.for_context(packer.ctx).authenticator is not None
    finally:
        for comp in (packer, trainer):
            comp.stop.set()
            comp.close()  # closes its courier and sockets, stops the authenticator, terms the context
        if handshake is not None:
            handshake.sock.close(linger=0)
        sup.shutdown()
    assert auth.for_context(packer.ctx) is None and auth.for_context(sup.ctx) is None


def test_busctl_keys_never_overwrites(tmp_path, capsys):
    assert cli.main(["keys", str(tmp_path / "keys"), "--clients", "3"]) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "keys").rglob("*") if p.is_file()}
    assert {"server.key", "server.key_secret", "components.key_secret", "client-1.key", "client-2.key_secret"} <= set(
        before
    )
    assert cli.main(["keys", str(tmp_path / "keys")]) == 1
    assert "already holds" in capsys.readouterr().err  # an error: on stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "keys").rglob("*") if p.is_file()} == before
    assert (tmp_path / "keys" / "server.key_secret").stat().st_mode & 0o077 == 0


# -- the launch-time check of the key files --------------------------------------------------------


def test_missing_key_dir_or_file_is_refused_at_launch(tmp_path, keys_dir, capsys):
    """The config loads without reading key files (``configs`` imports no bus); ``busctl up`` reads
    them before anything starts (``--dry-run`` too), as does ``busctl sbatch``: a missing directory or
    key file is a bad config, exit 2, with a message naming the path and how to make keys."""
    missing = tmp_path / "nowhere"
    partial = tmp_path / "partial"
    auth.create_keys(partial)
    (partial / "server.key_secret").unlink()
    cases = [
        ([f"bus.curve_keys_dir={missing}"], f"CurveZMQ key directory {missing} does not exist"),
        (
            [f"bus.curve_keys_dir={keys_dir}", "bus.curve_client=nobody"],
            f"CurveZMQ key file {keys_dir / 'clients' / 'nobody.key_secret'} does not exist",
        ),
        ([f"bus.curve_keys_dir={partial}"], f"CurveZMQ key file {partial / 'server.key_secret'} does not exist"),
    ]
    for overrides, message in cases:
        for transport in ("tcp", "ipc"):  # with ipc the keys are unused, but a config naming absent ones is wrong
            args = [f"bus.transport={transport}", *overrides]
            cfg = load_config(None, args)  # valid as a config: nothing read yet
            with pytest.raises(ValueError, match=re.escape(f"bus.curve_keys_dir: {message}")):
                auth.check_keys(cfg.bus)
            for command in (
                ["up", "--dry-run", f"run_dir={tmp_path / 'run'}"],
                ["sbatch", f"run_dir={tmp_path / 'run'}"],
            ):
                assert cli.main([*command, *args]) == 2, command
                out = capsys.readouterr()
                assert f"bus.curve_keys_dir: {message}; create one with `busctl keys DIR`" in out.err, command
                assert not out.out, command  # errors go to stderr: stdout stays what the command makes
    assert not (tmp_path / "run").exists()  # refused before anything was written
    auth.check_keys(load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={keys_dir}"]).bus)  # keys there: ok
    auth.check_keys(load_config(None, ["bus.transport=tcp"]).bus)  # no keys named: nothing to read


def test_a_component_opening_sockets_reads_the_keys(tmp_path):
    """A process started with a config whose key files went missing after launch fails as it opens
    its context, with the same message (the bus's own read, not the config's)."""
    keys = tmp_path / "keys"
    auth.create_keys(keys)
    cfg = load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={keys}", f"run_dir={tmp_path / 'run'}"])
    (keys / "clients" / "components.key_secret").unlink()
    with pytest.raises(
        ValueError, match=re.escape(f"CurveZMQ key file {keys / 'clients' / 'components.key_secret'} does not exist")
    ):
        Component(cfg, "packer", 0)


def test_curve_is_off_without_keys_and_on_ipc(keys_dir, caplog):
    assert auth.keys_from_config(load_config(None, ["bus.transport=tcp"]).bus) is None
    ipc = load_config(None, ["bus.transport=ipc", f"bus.curve_keys_dir={keys_dir}"])  # checked at launch, unused
    with caplog.at_level(logging.WARNING, logger="bus.auth"):
        assert auth.keys_from_config(ipc.bus) is None
    assert "tcp:// only" in caplog.text
    tcp = load_config(None, ["bus.transport=tcp", f"bus.curve_keys_dir={keys_dir}"])
    assert auth.keys_from_config(tcp.bus) == auth.CurveKeys.load(keys_dir)
