"""The weight path across hosts (issue 31.1): authenticated by default, open only when chosen.

With ``bus.transport: tcp`` and ``broadcast.method`` unset, weights take the bus method (the
trainer's ``weights`` ROUTER behind CurveZMQ), also when a multi-host launcher switches a loaded
config to tcp; an explicit ``broadcast`` is kept. On the real CURVE-secured weights endpoint, a
DEALER without CURVE and one with a client key outside the allow-list never get a bucket, while
the run's own client key does (same request, same socket options otherwise).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import zmq

from broadcaster.bus_method import BusSender
from broadcaster.manifest import build_manifest
from bus import auth
from bus.codec import decode, encode
from bus.messages_weights import WeightsBucket, WeightsRequest
from busctl.components.table import free_port
from busctl.launchers.multihost import configure_multihost
from busctl.launchers.nodes import Allocation
from configs.schema import dump_config, load_config

WAIT_MS = 1500  # a CURVE handshake and a bucket take milliseconds on loopback: a stranger is given this long
ANSWER_MS = 20_000  # the run's own key: bound on the first answer on a loaded CI host


@pytest.mark.parametrize(
    ("overrides", "method"),
    [
        (["bus.transport=tcp"], "bus"),  # the shipped YAML leaves the method unset
        (["bus.transport=tcp", "broadcast.method=broadcast"], "broadcast"),  # chosen: kept
        (["bus.transport=tcp", "broadcast.method=filesystem"], "filesystem"),
        ([], "broadcast"),  # ipc: one host, the torch.distributed broadcast
    ],
)
def test_tcp_defaults_to_the_bus_method_unless_one_is_chosen(overrides, method):
    assert load_config(None, overrides).broadcast.method == method


@pytest.mark.parametrize(("overrides", "method"), [([], "bus"), (["broadcast.method=broadcast"], "broadcast")])
def test_a_multihost_launcher_applies_the_default_too(tmp_path, overrides, method):
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", *overrides])  # loaded as ipc
    configure_multihost(
        cfg,
        Allocation((("n1", "n2"),)),
        resolve={"n1": "10.0.0.1", "n2": "10.0.0.2"}.get,
        supervisor_host="n1",
        here="n1",
    )
    assert cfg.bus.transport == "tcp" and cfg.broadcast.method == method
    assert (Path(cfg.bus.curve_keys_dir) / "tls" / "client.crt").is_file()  # the run's keys carry the metrics TLS
    saved = tmp_path / "config.yaml"  # what the supervisor writes into the run directory, and a resume reads
    saved.write_text(dump_config(cfg))
    reloaded = load_config(saved)
    assert reloaded.bus.transport == "tcp" and reloaded.broadcast.method == method
    assert reloaded.bus.curve_keys_dir == cfg.bus.curve_keys_dir


def _ask(
    ctx: zmq.Context, address: str, curve: tuple[bytes, bytes, bytes] | None, wait_ms: int = WAIT_MS
) -> list[WeightsBucket]:
    """Send one WeightsRequest for bucket 0 from a fresh DEALER; what comes back: the first
    message within ``wait_ms``, then any other within WAIT_MS of the previous one."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    if curve is not None:
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = curve
    dealer.connect(address)
    try:
        dealer.send_multipart(
            encode(WeightsRequest(id="probe", producer="stranger", version=0, buckets=[0])), copy=False
        )
        got = []
        while dealer.poll(WAIT_MS if got else wait_ms):
            got.append(decode(dealer.recv_multipart()))
        return got
    finally:
        dealer.close(linger=0)


def test_an_unknown_peer_cannot_join_the_weight_path(tmp_path):
    keys_dir, other_dir = tmp_path / "keys", tmp_path / "other"
    auth.create_keys(keys_dir)
    auth.create_keys(other_dir)
    run_keys, stranger = auth.CurveKeys.load(keys_dir), auth.CurveKeys.load(other_dir)
    trainer_ctx, peer_ctx = zmq.Context(), zmq.Context()
    auth.enable(trainer_ctx, run_keys)
    address = f"tcp://127.0.0.1:{free_port()}"
    sender = BusSender(trainer_ctx, address)
    state = {"w": torch.arange(64, dtype=torch.float32)}
    try:
        sender.start_send(state, 0, build_manifest(state))
        assert _ask(peer_ctx, address, None) == []  # no CURVE at all
        unknown = (run_keys.server_public, stranger.client_public, stranger.client_secret)  # knows the server key
        assert _ask(peer_ctx, address, unknown) == []  # a client key outside the allow-list
        known = (run_keys.server_public, run_keys.client_public, run_keys.client_secret)
        (bucket,) = _ask(peer_ctx, address, known, ANSWER_MS)  # the same request with the run's key is answered
        assert isinstance(bucket, WeightsBucket) and bucket.version == 0 and bucket.index == 0
        assert torch.equal(torch.from_numpy(bucket.data.copy()).view(torch.float32)[:64], state["w"])
    finally:
        sender.close()
        auth.disable(trainer_ctx)
        trainer_ctx.term()
        peer_ctx.term()


def test_a_chosen_broadcast_reachable_from_other_hosts_is_warned_about(tmp_path, caplog):
    from broadcaster.factory import build_senders, open_rendezvous_warning
    from configs.schema import BroadcastConfig

    open_group = BroadcastConfig(method="broadcast", backend="gloo", host="10.0.0.1", port=29500)
    with caplog.at_level("WARNING", logger="broadcaster.factory"):
        sender, _ = build_senders(open_group, world_size=2, out_dir=tmp_path)  # not opened: no rendezvous yet
    assert sender.method == "broadcast"
    assert "10.0.0.1:29500" in caplog.text and "accept any peer" in caplog.text
    assert open_rendezvous_warning(BroadcastConfig(method="broadcast", host="127.0.0.1")) is None  # one host
    assert open_rendezvous_warning(BroadcastConfig(method="bus", host="10.0.0.1")) is None  # authenticated
